"""The variables a TensorFlow ScaleCom is built for: checked, named and described as ``(name, shape,
dtype)``; gradients are matched to them by position."""

import numpy as np
import tensorflow as tf


def dtype_text(dtype):
    """tf/np dtypes as the names ``check_dtype_name`` expects; anything else unchanged."""
    if isinstance(dtype, tf.DType):
        return dtype.name
    if isinstance(dtype, type) and issubclass(dtype, np.generic) or isinstance(dtype, np.dtype):
        return np.dtype(dtype).name
    return dtype


def _is_keras_variable(value):
    import sys
    keras = sys.modules.get("keras")
    return keras is not None and isinstance(value, keras.Variable)


def variable_specs(variables):
    """[(unique name, shape tuple, tf dtype)] of ``variables``; TypeError/ValueError on bad input."""
    message = ("variables must be an iterable of tf.Variable or keras.Variable, such as "
               "model.trainable_variables")
    if variables is None or isinstance(variables, (str, bytes, tf.Tensor, tf.Variable)) \
            or _is_keras_variable(variables):
        raise TypeError(message)
    try:
        items = list(variables)
    except TypeError:
        raise TypeError(message) from None
    if not items:
        raise ValueError("variables is empty")
    specs, seen = [], set()
    for index, v in enumerate(items):
        if isinstance(v, tf.Variable):
            name = v.name[:-2] if v.name.endswith(":0") else v.name
        elif _is_keras_variable(v):
            name = v.path
        else:
            raise TypeError(f"variables[{index}] is a {type(v).__name__}; {message}")
        if id(v) in seen:
            raise ValueError(f"variables has {name!r} twice")
        seen.add(id(v))
        dtype = tf.as_dtype(v.dtype)
        if not dtype.is_floating:
            raise TypeError(f"variables[{index}] {name!r} is {dtype.name}, ScaleCom compresses "
                            f"floating-point variables")
        if dtype == tf.bfloat16:
            raise TypeError(f"variables[{index}] {name!r} is bfloat16: Horovod's TensorFlow collectives have "
                            f"no bfloat16 kernel, so its gradient cannot be reduced, with ScaleCom or without "
                            f"(a mixed_bfloat16 policy keeps variables in float32)")
        shape = tuple(v.shape)
        if any(d is None for d in shape):
            raise ValueError(f"variables[{index}] {name!r} has an unknown shape {shape}")
        specs.append((name, tuple(int(d) for d in shape), dtype))
    counts = {}
    for name, _, _ in specs:
        counts[name] = counts.get(name, 0) + 1
    # Names key state_dict(); repeated ones (unnamed tf.Variables) get their position appended.
    return [(name if counts[name] == 1 else f"{name}#{i}", shape, dtype)
            for i, (name, shape, dtype) in enumerate(specs)]
