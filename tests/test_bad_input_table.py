"""Bad input to every public constructor, and to load_state_dict, in one table: each row names the
constructor, the argument, the bad value, the exception type and the text its message must hold
(normally the argument's name). Single-process: nothing here needs a Horovod job.

Each failed call must leave nothing half-changed: a rejected load_state_dict leaves state_dict()
exactly as it was (tensors compared bit for bit).
"""


import pytest
import torch
from workers.states import same

from hvd_scalecom import sim
from hvd_scalecom.config import ScaleComConfig


def named():
    torch.manual_seed(0)
    return list(torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 2)).named_parameters())


def torch_scalecom(**kwargs):
    from hvd_scalecom.torch import ScaleCom
    return ScaleCom(kwargs.pop("named_parameters", named()), **kwargs)


def torch_sketched(**kwargs):
    from hvd_scalecom.torch import SketchedSGD
    return SketchedSGD(kwargs.pop("named_parameters", named()), **kwargs)


def torch_qsparse(**kwargs):
    from hvd_scalecom.torch import QsparseLocalSGD
    default = named()
    pairs = kwargs.pop("named_parameters", default)
    optimizer = kwargs.pop("optimizer", None) or torch.optim.SGD([p for _, p in default], lr=0.1)
    return QsparseLocalSGD(optimizer, pairs, **kwargs)


def simulator(**kwargs):
    scheme = kwargs.pop("scheme", None) or sim.ScaleCom()
    return sim.Simulator(scheme, kwargs.pop("n_workers", 2), kwargs.pop("named_parameters", named()),
                         **kwargs)


PARAM = torch.nn.Parameter(torch.zeros(3))
NAN = float("nan")

# (constructor, argument, bad value, exception, text in the message)
ROWS = [
    # ScaleComConfig: the validation every ScaleCom and simulator scheme shares.
    (ScaleComConfig, "ratio", 0, ValueError, "ratio"),
    (ScaleComConfig, "ratio", 1.5, ValueError, "ratio"),
    (ScaleComConfig, "ratio", NAN, ValueError, "ratio"),
    (ScaleComConfig, "ratio", "0.1", ValueError, "ratio"),
    (ScaleComConfig, "ratio", True, ValueError, "ratio"),
    (ScaleComConfig, "beta", 0, ValueError, "beta"),
    (ScaleComConfig, "beta", 1.01, ValueError, "beta"),
    (ScaleComConfig, "beta", None, ValueError, "beta"),
    (ScaleComConfig, "warmup_steps", -1, ValueError, "warmup_steps"),
    (ScaleComConfig, "warmup_steps", 1.5, TypeError, "warmup_steps"),
    (ScaleComConfig, "warmup_steps", True, TypeError, "warmup_steps"),
    (ScaleComConfig, "min_numel", -3, ValueError, "min_numel"),
    (ScaleComConfig, "min_numel", "8", TypeError, "min_numel"),
    (ScaleComConfig, "leader", "random", ValueError, "leader"),
    (ScaleComConfig, "leader", None, ValueError, "leader"),
    (ScaleComConfig, "selection", "approximate", ValueError, "selection"),
    (ScaleComConfig, "value_dtype", "int8", ValueError, "value_dtype"),
    (ScaleComConfig, "index_dtype", "float32", ValueError, "index_dtype"),
    (ScaleComConfig, "index_dtype", None, ValueError, "index_dtype"),
    (ScaleComConfig, "pipelined", 1, TypeError, "pipelined"),
    (ScaleComConfig, "pipelined", "yes", TypeError, "pipelined"),
    # hvd_scalecom.torch.ScaleCom
    (torch_scalecom, "ratio", 0, ValueError, "ratio"),
    (torch_scalecom, "ratio", 1.5, ValueError, "ratio"),
    (torch_scalecom, "ratio", NAN, ValueError, "ratio"),
    (torch_scalecom, "ratio", "0.1", ValueError, "ratio"),
    (torch_scalecom, "beta", 0, ValueError, "beta"),
    (torch_scalecom, "beta", 1.01, ValueError, "beta"),
    (torch_scalecom, "warmup_steps", -1, ValueError, "warmup_steps"),
    (torch_scalecom, "warmup_steps", 1.5, TypeError, "warmup_steps"),
    (torch_scalecom, "min_numel", -3, ValueError, "min_numel"),
    (torch_scalecom, "leader", "random", ValueError, "leader"),
    (torch_scalecom, "selection", "approximate", ValueError, "selection"),
    (torch_scalecom, "value_dtype", torch.int8, ValueError, "value_dtype"),
    (torch_scalecom, "value_dtype", 3, ValueError, "value_dtype"),
    (torch_scalecom, "value_dtype", torch.bfloat16, ValueError, "value_dtype"),  # (Horovod takes no bf16)
    (torch_scalecom, "index_dtype", torch.float32, ValueError, "index_dtype"),
    (torch_scalecom, "pipelined", "yes", TypeError, "pipelined"),
    (torch_scalecom, "index_exchange", "allreduce", ValueError, "index_exchange"),
    (torch_scalecom, "index_exchange", None, ValueError, "index_exchange"),
    (torch_scalecom, "timeout", -1, ValueError, "timeout"),
    (torch_scalecom, "timeout", 0, ValueError, "timeout"),
    (torch_scalecom, "timeout", NAN, ValueError, "timeout"),
    (torch_scalecom, "timeout", True, ValueError, "timeout"),
    (torch_scalecom, "timeout", "10", ValueError, "timeout"),
    (torch_scalecom, "loss_scaler", 1024.0, TypeError, "loss_scaler"),
    (torch_scalecom, "loss_scaler", torch.amp.GradScaler, TypeError, "GradScaler (a class: pass an instance)"),
    (torch_scalecom, "process_set", [0, 1], TypeError, "process_set"),
    (torch_scalecom, "named_parameters", None, TypeError, "named_parameters"),
    (torch_scalecom, "named_parameters", 3, TypeError, "named_parameters"),
    (torch_scalecom, "named_parameters", "weights", TypeError, "named_parameters"),
    (torch_scalecom, "named_parameters", [], ValueError, "named_parameters is empty"),
    (torch_scalecom, "named_parameters", [torch.zeros(3)], TypeError, "named_parameters"),
    (torch_scalecom, "named_parameters", [("a", [1.0, 2.0])], TypeError, "named_parameters"),
    (torch_scalecom, "named_parameters", [("a", torch.zeros(3)), ("a", torch.zeros(2))], ValueError,
     "'a' twice"),
    (torch_scalecom, "named_parameters", [("a", PARAM), ("b", PARAM)], ValueError, "two names"),
    (torch_scalecom, "named_parameters", [("w", torch.zeros(3, dtype=torch.int64))], TypeError,
     "floating-point"),
    # hvd_scalecom.torch.SketchedSGD
    (torch_sketched, "ratio", 0, ValueError, "ratio"),
    (torch_sketched, "rows", 0, ValueError, "rows"),
    (torch_sketched, "rows", 2.0, TypeError, "rows"),
    (torch_sketched, "columns", 0, ValueError, "columns"),
    (torch_sketched, "columns", "100", TypeError, "columns"),
    (torch_sketched, "columns", 2**31, ValueError, "columns must be below 2**31"),
    (torch_sketched, "candidates", 0, ValueError, "candidates"),
    (torch_sketched, "momentum", 1.0, ValueError, "momentum"),
    (torch_sketched, "momentum", "0.9", TypeError, "momentum"),
    (torch_sketched, "warmup_steps", -1, ValueError, "warmup_steps"),
    (torch_sketched, "min_numel", 1.5, TypeError, "min_numel"),
    (torch_sketched, "seed", -1, ValueError, "seed"),
    (torch_sketched, "seed", None, TypeError, "seed"),
    (torch_sketched, "process_set", "all", TypeError, "process_set"),
    (torch_sketched, "loss_scaler", 1024.0, TypeError, "loss_scaler"),
    (torch_sketched, "name", None, TypeError, "name must be a str"),
    (torch_sketched, "name", "", ValueError, "name must not be empty"),
    (torch_sketched, "named_parameters", [], ValueError, "named_parameters is empty"),
    (torch_sketched, "named_parameters", [("a", torch.zeros(3)), ("a", torch.zeros(2))], ValueError,
     "'a' twice"),
    # hvd_scalecom.torch.QsparseLocalSGD
    (torch_qsparse, "optimizer", "sgd", TypeError, "optimizer"),
    (torch_qsparse, "local_steps", 0, ValueError, "local_steps"),
    (torch_qsparse, "local_steps", 2.5, TypeError, "local_steps"),
    (torch_qsparse, "ratio", 2.0, ValueError, "ratio"),
    (torch_qsparse, "max_k", 0, ValueError, "max_k"),
    (torch_qsparse, "operator", "top_k_sign", ValueError, "operator"),
    (torch_qsparse, "levels", 0, ValueError, "levels"),
    (torch_qsparse, "levels", 2**24 + 1, ValueError, "levels"),
    (torch_qsparse, "min_numel", -1, ValueError, "min_numel"),
    (torch_qsparse, "seed", "0", TypeError, "seed"),
    (torch_qsparse, "index_dtype", "float32", ValueError, "index_dtype"),
    (torch_qsparse, "index_dtype", torch.float32, ValueError, "index_dtype"),
    (torch_qsparse, "process_set", 2, TypeError, "process_set"),
    (torch_qsparse, "named_parameters", [], ValueError, "named_parameters is empty"),
    # hvd_scalecom.sim schemes
    (sim.Dense, "wire_dtype", "int8", ValueError, "wire_dtype"),
    (sim.ScaleCom, "ratio", 0, ValueError, "ratio"),
    (sim.ScaleCom, "beta", 2, ValueError, "beta"),
    (sim.ScaleCom, "leader", "random", ValueError, "leader"),
    (sim.ScaleCom, "pipelined", None, TypeError, "pipelined"),
    (sim.LocalTopK, "ratio", -0.1, ValueError, "ratio"),
    (sim.LocalTopK, "index_dtype", "int16", ValueError, "index_dtype"),
    (sim.GlobalTopK, "traffic", "sparse", ValueError, "traffic"),
    (sim.GlobalTopK, "beta", 0, ValueError, "beta"),
    (sim.GTopK, "warmup_steps", -2, ValueError, "warmup_steps"),
    (sim.GTopK, "value_dtype", "int8", ValueError, "value_dtype"),
    (sim.RandomK, "ratio", 0, ValueError, "ratio"),
    (sim.RandomK, "seed", "x", TypeError, "seed"),
    (sim.RandomK, "seed", -1, ValueError, "seed"),
    (sim.SketchedSGD, "rows", 0, ValueError, "rows"),
    (sim.SketchedSGD, "momentum", -0.5, ValueError, "momentum"),
    (sim.QsparseLocalSGD, "lr", "fast", TypeError, "lr"),
    (sim.QsparseLocalSGD, "lr", -0.1, ValueError, "lr"),
    (sim.QsparseLocalSGD, "lr", NAN, ValueError, "lr"),
    (sim.QsparseLocalSGD, "momentum", 1.0, ValueError, "momentum"),
    (sim.QsparseLocalSGD, "momentum", "0.9", TypeError, "momentum"),
    (sim.QsparseLocalSGD, "local_steps", 0, ValueError, "local_steps"),
    (sim.QsparseLocalSGD, "operator", "qsgd", ValueError, "operator"),
    (sim.PowerSGD, "rank", 0, ValueError, "rank"),
    (sim.PowerSGD, "rank", 2.0, TypeError, "rank"),
    (sim.PowerSGD, "rank", True, TypeError, "rank"),
    (sim.PowerSGD, "min_numel", -1, ValueError, "min_numel"),
    (sim.PowerSGD, "seed", "x", TypeError, "seed"),
    (simulator, "scheme", "scalecom", TypeError, "scheme"),
    (simulator, "n_workers", 0, ValueError, "n_workers"),
    (simulator, "n_workers", 2.0, TypeError, "n_workers"),
    (simulator, "n_workers", True, TypeError, "n_workers"),
    (simulator, "named_parameters", [], ValueError, "named_parameters is empty"),
    (simulator, "named_parameters", 5, TypeError, "named_parameters"),
    (simulator, "named_parameters", [("a", torch.zeros(3)), ("a", torch.zeros(2))], ValueError,
     "'a' twice"),
    (simulator, "named_parameters", [("a", torch.zeros(3, dtype=torch.int32))], TypeError,
     "floating-point"),
    (simulator, "named_parameters", [("a", torch.zeros(3))], ValueError, "'a' does not require grad"),
    (simulator, "device", "bogus", ValueError, "device 'bogus'"),
    (simulator, "device", "cuda:999", ValueError, "device"),
    (simulator, "device", 1.5, TypeError, "device"),
]
SIM_DEFAULTS = {sim.QsparseLocalSGD: {"lr": 0.1}}


def row_id(row):
    constructor, argument, value = row[:3]
    return f"{getattr(constructor, '__qualname__', constructor)}-{argument}={value!r:.30}"


@pytest.mark.parametrize("constructor, argument, value, error, text", ROWS, ids=[row_id(r) for r in ROWS])
def test_bad_constructor_argument(constructor, argument, value, error, text):
    kwargs = {**SIM_DEFAULTS.get(constructor, {}), argument: value}
    with pytest.raises(error) as failure:
        constructor(**kwargs)
    assert text in str(failure.value), str(failure.value)


# -- TensorFlow frontend (rows not already in test_tensorflow_scalecom.py); values are built lazily ----

def tf_scalecom(tf, keras, **kwargs):
    from hvd_scalecom.tensorflow import ScaleCom
    variables = kwargs.pop("variables", None)
    if variables is None:
        variables = [tf.Variable(tf.zeros([40, 30])), tf.Variable(tf.zeros([5]))]
    return ScaleCom(variables, **kwargs)


def keras_model(keras):
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(2)])


def tf_train_step(tf, keras, **kwargs):
    from hvd_scalecom.tensorflow import make_train_step
    model = kwargs.pop("model", None) or keras_model(keras)
    optimizer = kwargs.pop("optimizer", None) or keras.optimizers.SGD(0.1)
    return make_train_step(model, optimizer, kwargs.pop("loss", "mse"), **kwargs)


def tf_distributed_optimizer(tf, keras, **kwargs):
    from hvd_scalecom.tensorflow import DistributedOptimizer
    return DistributedOptimizer(kwargs.pop("optimizer", None) or keras.optimizers.SGD(0.1), **kwargs)


def tf_broadcast_initial_state(tf, keras, **kwargs):
    from hvd_scalecom.tensorflow import BroadcastInitialState
    return BroadcastInitialState(**kwargs)


TF_ROWS = [
    (tf_scalecom, "ratio", lambda tf, keras: float("nan"), ValueError, "ratio"),
    (tf_scalecom, "ratio", lambda tf, keras: True, ValueError, "ratio"),
    (tf_scalecom, "beta", lambda tf, keras: None, ValueError, "beta"),
    (tf_scalecom, "warmup_steps", lambda tf, keras: True, TypeError, "warmup_steps"),
    (tf_scalecom, "min_numel", lambda tf, keras: 10.0, TypeError, "min_numel"),
    (tf_scalecom, "leader", lambda tf, keras: 0, ValueError, "leader"),
    (tf_scalecom, "value_dtype", lambda tf, keras: 3, ValueError, "value_dtype"),
    (tf_scalecom, "value_dtype", lambda tf, keras: tf.float64, ValueError, "value_dtype"),
    (tf_scalecom, "index_dtype", lambda tf, keras: None, ValueError, "index_dtype"),
    (tf_scalecom, "index_exchange", lambda tf, keras: None, ValueError, "index_exchange"),
    (tf_scalecom, "process_set", lambda tf, keras: [0, 1], TypeError, "process_set"),
    (tf_scalecom, "variables", lambda tf, keras: 5, TypeError, "variables"),
    (tf_scalecom, "variables", lambda tf, keras: "w", TypeError, "variables"),
    (tf_scalecom, "variables", lambda tf, keras: [tf.Variable(tf.zeros([3]), name="w")] * 2, ValueError,
     "twice"),
    (tf_scalecom, "variables", lambda tf, keras: [tf.Variable(tf.zeros([3], tf.bfloat16), name="w")], TypeError,
     "'w' is bfloat16: Horovod's TensorFlow collectives have no bfloat16 kernel"),
    (tf_train_step, "model", lambda tf, keras: "model", TypeError, "model"),
    (tf_train_step, "model", lambda tf, keras: keras.Sequential([keras.layers.Dense(2)]), ValueError,
     "built"),
    (tf_train_step, "optimizer", lambda tf, keras: "sgd", TypeError, "optimizer"),
    (tf_train_step, "loss", lambda tf, keras: 3, TypeError, "loss"),
    (tf_train_step, "loss", lambda tf, keras: "no_such_loss", ValueError, "no_such_loss"),
    (tf_train_step, "compression", lambda tf, keras: "scalecom", TypeError, "compression"),
    (tf_train_step, "root_rank", lambda tf, keras: -1, ValueError, "root_rank"),
    (tf_train_step, "root_rank", lambda tf, keras: "0", TypeError, "root_rank"),
    (tf_distributed_optimizer, "optimizer", lambda tf, keras: "sgd", TypeError, "optimizer"),
    (tf_distributed_optimizer, "compression", lambda tf, keras: 0.01, TypeError, "compression"),
    (tf_distributed_optimizer, "sparse_as_dense", lambda tf, keras: "yes", TypeError, "sparse_as_dense"),
    (tf_broadcast_initial_state, "root_rank", lambda tf, keras: -1, ValueError, "root_rank"),
    (tf_broadcast_initial_state, "root_rank", lambda tf, keras: 0.0, TypeError, "root_rank"),
]


@pytest.mark.parametrize("constructor, argument, value, error, text", TF_ROWS,
                         ids=[f"{r[0].__name__}-{r[1]}-{i}" for i, r in enumerate(TF_ROWS)])
def test_bad_tensorflow_argument(constructor, argument, value, error, text):
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    with pytest.raises(error) as failure:
        constructor(tf, keras, **{argument: value(tf, keras)})
    assert text in str(failure.value), str(failure.value)


# -- load_state_dict: every rejected state leaves state_dict() exactly as it was --------------------


def with_last(good, **entry):
    """``good`` with every parameter's entry changed validly (step 9) but the last one's broken by
    ``entry``: a load that applies entries one by one before failing shows as a changed state."""
    return with_broken(good, list(good["params"])[-1], **entry)


def with_broken(good, name, **entry):
    """As :func:`with_last`, the entry of parameter ``name`` broken (the others' steps set to 9, and
    their next_indices, which must be for the entry's step, with them)."""
    params = {n: {**e, "step": 9, **({"next_indices": (9, e["next_indices"][1])} if "next_indices" in e else {})}
              for n, e in good["params"].items()}
    params[name] = {**params[name], **entry}
    return {**good, "params": params}


def per_parameter_rows(good, tensor_key, numel_text):
    names = list(good["params"])
    last = names[-1]
    return [
        ("not a dict", ValueError, "state"),
        (None, ValueError, "state"),
        ({"params": good["params"]}, ValueError, "state"),
        ({**good, "config": {**good["config"], "ratio": 0.5}}, ValueError, "config"),
        ({**good, "params": {n: good["params"][n] for n in names[:-1]}}, ValueError, f"missing [{last!r}]"),
        ({**good, "params": {**good["params"], "extra": good["params"][last]}}, ValueError,
         "unexpected ['extra']"),
        (with_last(good, **{tensor_key: torch.ones(5)}), ValueError, numel_text),
        # finite in float64, Inf in the float32 it is kept in
        (with_last(good, **{tensor_key: torch.full(good["params"][last]["shape"], 1e39, dtype=torch.float64)}),
         ValueError, f"{tensor_key} of {last!r} holds entries beyond the range of torch.float32"),
        (with_last(good, **{tensor_key: [0.0, 1.0]}), TypeError, tensor_key),
        (with_last(good, step=-1), ValueError, "step"),
        (with_last(good, step="x"), TypeError, "step"),
        (with_last(good, step=2.5), TypeError, "step"),
        ({**good, "params": {**with_last(good)["params"], last: "entry"}}, TypeError, last),
        (with_last(good, shape=[5]), ValueError, f"state of {last!r} was saved for a parameter of shape (5,)"),
        (with_last(good, shape="2x1"), ValueError, "state shape"),
        # a transposed parameter of the same name has as many entries
        (with_broken(good, names[0], shape=good["params"][names[0]]["shape"][::-1]), ValueError, "shape (40, 30)"),
    ]


def trained_scalecom():
    """A ScaleCom whose state differs from a fresh one's (steps and memories as after training)."""
    compression = torch_scalecom(ratio=0.1, min_numel=50)
    state = compression.state_dict()
    for i, entry in enumerate(state["params"].values()):
        entry["step"] = 4
        entry["memory"] = torch.full((compression._slots[i].param.numel(),), 0.5 + i)
    compression.load_state_dict(state)
    return compression


def scalecom_rows(good):
    kept = next(n for n, e in good["params"].items() if e["memory"] is not None)
    return per_parameter_rows(good, "memory", "5 entries") + [
        (with_last(good, memory=torch.ones(2, dtype=torch.int64)), TypeError, "memory"),
        (with_broken(good, kept, memory=torch.full_like(good["params"][kept]["memory"], float("inf"))), ValueError,
         "non-finite"),
        (with_last(good, scale=-2.0), ValueError, "scale"),
        (with_last(good, step=2 ** 63), ValueError, "below 2**63"),
        (with_last(good, scale="x"), ValueError, "scale"),
        (with_broken(good, "1.weight", next_indices=(4, torch.arange(6, dtype=torch.int32))), ValueError,
         "never selects ahead"),
    ]


def trained_pipelined_scalecom():
    """A pipelined ScaleCom holding next-step indices for its compressed parameters."""
    compression = torch_scalecom(ratio=0.1, min_numel=50, pipelined=True)
    state = compression.state_dict()
    for i, entry in enumerate(state["params"].values()):
        numel = compression._slots[i].param.numel()
        entry["step"] = 4
        entry["memory"] = torch.full((numel,), 0.5 + i)
        if numel >= 50:
            entry["next_indices"] = (4, torch.arange(0, numel, 10, dtype=torch.int32))
    compression.load_state_dict(state)
    return compression


def pipelined_scalecom_rows(good):
    """Bad next-step indices on "1.weight" (60 entries, k = 6), after "0.weight"'s good ones."""
    ahead = good["params"]["1.weight"]["next_indices"][1]
    return [
        (with_broken(good, "1.weight", next_indices="x"), ValueError, "(step, indices)"),
        (with_broken(good, "1.weight", next_indices=(4,)), ValueError, "(step, indices)"),
        (with_broken(good, "1.weight", next_indices=(-1, ahead)), ValueError, "step"),
        (with_broken(good, "1.weight", next_indices=(True, ahead)), ValueError, "step"),
        (with_broken(good, "1.weight", next_indices=(4, ahead[:5])), ValueError, "6 distinct integers in [0, 60)"),
        (with_broken(good, "1.weight", next_indices=(4, ahead + 60)), ValueError, "6 distinct integers in [0, 60)"),
        (with_broken(good, "1.weight", next_indices=(4, ahead[:1].repeat(6))), ValueError, "6 distinct integers"),
        (with_broken(good, "1.weight", next_indices=(4, ahead.float())), ValueError, "6 distinct integers"),
        (with_broken(good, "1.bias", next_indices=(4, ahead[:1])), ValueError, "never selects ahead"),
        # for a step other than the entry's (9): that rank exchanged fresh indices while others used theirs
        (with_broken(good, "1.weight", next_indices=(4, ahead)), ValueError,
         "next_indices of '1.weight' are for step 4, but its step counter is 9"),
    ]


def sketched_rows(good):
    return per_parameter_rows(good, "momentum", "5 entries")


def qsparse_rows(good):
    mine = good["qsparse_local_sgd"]

    def wrapper(**changes):
        return {**good, "qsparse_local_sgd": {**mine, **changes}}

    last = list(mine["params"])[-1]
    params = {n: {**e} for n, e in mine["params"].items()}
    params[last]["memory"] = torch.ones(5)
    nonfinite = {n: {**e} for n, e in mine["params"].items()}
    nonfinite[last]["shared"] = torch.full((dict(named())[last].numel(),), NAN)
    return [
        ("not a dict", ValueError, "state_dict"),
        ({"state": {}}, ValueError, "state_dict"),
        (wrapper(config={**mine["config"], "ratio": 0.5}), ValueError, "config"),
        (wrapper(params={}), ValueError, "missing"),
        (wrapper(params=params), ValueError, "5 entries"),
        (wrapper(params=nonfinite), ValueError, "non-finite"),
        (wrapper(params={**mine["params"], last: {**mine["params"][last], "memory": torch.full(
            (dict(named())[last].numel(),), 1e39, dtype=torch.float64)}}), ValueError,
         "beyond the range of torch.float32"),
        (wrapper(params={**mine["params"], "0.weight": {**mine["params"]["0.weight"], "shape": [40, 30]}}),
         ValueError, "shape (40, 30)"),
        (wrapper(step=-1), ValueError, "step"),
        (wrapper(step="x"), TypeError, "step"),
        (wrapper(step=3, generator="seed"), TypeError, "generator"),
    ]


def trained_simulator():
    simulator_ = simulator(scheme=sim.ScaleCom(ratio=0.1, min_numel=50))
    torch.manual_seed(1)
    simulator_.step([[torch.randn_like(p) for p in simulator_.params] for _ in range(2)])
    return simulator_


def simulator_rows(good):
    scheme = good["scheme"]
    short = {n: {k: v[..., :1] for k, v in e.items()} for n, e in scheme["state"].items()}
    return [
        ("not a dict", ValueError, "state"),
        ({**good, "n": 3}, ValueError, "workers"),
        ({**good, "names": good["names"][:-1]}, ValueError, "parameters"),
        ({**good, "scheme": "scheme"}, ValueError, "scheme"),
        ({**good, "scheme": {**scheme, "scheme": "dense"}}, ValueError, "scheme"),
        ({**good, "scheme": {**scheme, "n": 3}}, ValueError, "workers"),
        ({**good, "step": -1}, ValueError, "step"),
        ({**good, "step": "x"}, TypeError, "step"),
        ({**good, "history": None}, TypeError, "history"),
        ({**good, "step": 5, "scheme": {**scheme, "state": short}}, ValueError, "shape"),
    ]


def fresh_simulator_rows(good):
    """A simulator that has not stepped yet holds no memory: a saved one must still fit its parameter."""
    scheme = good["scheme"]
    first = list(scheme["state"])[0]
    state = lambda entry: {**scheme, "state": {**scheme["state"], first: entry}}  # noqa: E731
    return [
        ({**good, "scheme": state({"memory": torch.zeros(3, 5)})}, ValueError, "shape"),
        ({**good, "scheme": state({"memory": torch.zeros(2, 1200, 1)})}, ValueError, "shape"),
        ({**good, "scheme": state({"memory": [0.0]})}, TypeError, "tensor"),
        ({**good, "scheme": state("entry")}, TypeError, first),
    ]


def fresh_sketched_simulator():
    return simulator(scheme=sim.SketchedSGD(ratio=0.1, min_numel=50))


def sketched_simulator_rows(good):
    extra = lambda **e: {**good, "scheme": {**good["scheme"], "extra": e}}  # noqa: E731
    numel = 1200 + 60  # the sketched weights
    return [
        (extra(u=torch.zeros(2, numel), v=5), ValueError, "u and v"),
        (extra(u=torch.zeros(2, numel), v=None), ValueError, "u and v"),
        (extra(u=torch.zeros(2, 7), v=torch.zeros(2, 7)), ValueError, f"(2, {numel})"),
    ]


LOADERS = {"ScaleCom": (trained_scalecom, scalecom_rows),
           "Simulator, fresh": (simulator, fresh_simulator_rows),
           "Simulator, SketchedSGD": (fresh_sketched_simulator, sketched_simulator_rows),
           "ScaleCom, pipelined": (trained_pipelined_scalecom, pipelined_scalecom_rows),
           "SketchedSGD": (lambda: torch_sketched(ratio=0.1, min_numel=50), sketched_rows),
           "QsparseLocalSGD": (lambda: torch_qsparse(ratio=0.1), qsparse_rows),
           "Simulator": (trained_simulator, simulator_rows)}
LOAD_ROWS = [(kind, i) for kind, (make, rows) in LOADERS.items()
             for i in range(len(rows(make().state_dict())))]


@pytest.mark.parametrize("kind", ["ScaleCom", "SketchedSGD", "QsparseLocalSGD"])
def test_a_state_saved_without_shapes_loads(kind):
    """Entries of an earlier version have no ``shape``: they load, matched by name and entry count."""
    make, _ = LOADERS[kind]
    expected, saved = make().state_dict(), make().state_dict()
    mine = saved.get("qsparse_local_sgd", saved)
    assert all(list(dict(named())[n].shape) == e.pop("shape") for n, e in mine["params"].items())
    target = torch_scalecom(ratio=0.1, min_numel=50) if kind == "ScaleCom" else make()  # (a fresh one)
    target.load_state_dict(saved)
    assert same(target.state_dict(), expected)


@pytest.mark.parametrize("kind, row", LOAD_ROWS, ids=[f"{k}-{i}" for k, i in LOAD_ROWS])
def test_bad_state_changes_nothing(kind, row):
    make, rows = LOADERS[kind]
    target = make()
    before = target.state_dict()
    state, error, text = rows(target.state_dict())[row]
    with pytest.raises(error) as failure:
        target.load_state_dict(state)
    assert text in str(failure.value), str(failure.value)
    assert same(target.state_dict(), before), "a rejected state changed the object"
    target.load_state_dict(before)  # and the good state still loads
    assert same(target.state_dict(), before)


def test_a_saved_memory_loads_flat_in_the_memorys_dtype_and_on_its_own_storage():
    """A memory saved as another shape of the same size (or in fp16) is restored as compress keeps it:
    flat, fp32 for fp32 parameters, a copy of what was given."""
    compression = trained_scalecom()
    state = compression.state_dict()
    saved = torch.arange(1200, dtype=torch.float16).view(1200, 1)
    state["params"]["0.weight"]["memory"] = saved
    compression.load_state_dict(state)
    memory = compression.state_dict()["params"]["0.weight"]["memory"]
    assert memory.shape == (1200,) and memory.dtype == torch.float32
    assert torch.equal(memory, torch.arange(1200, dtype=torch.float32))
    saved.zero_()
    assert torch.equal(compression.state_dict()["params"]["0.weight"]["memory"], memory)
