"""Read a Horovod timeline (``HOROVOD_TIMELINE=file``): what each collective really moved.

Horovod writes Chrome-trace JSON where each tensor name gets a ``pid`` and the end event of every
operation carries the output's dtype and shape. This turns it into one record per operation.
"""

import json

_ITEMSIZE = {"uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "float16": 2, "bfloat16": 2,
             "int32": 4, "float32": 4, "int64": 8, "float64": 8, "bool": 1}


def _events(text):
    """The JSON array of events; a timeline whose job is still running or was killed is not closed,
    and its last record may be cut short: such a record is dropped."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    while text:
        try:
            return json.loads(text + "]")
        except json.JSONDecodeError:  # back to the end of an earlier record, "}" (with a comma after)
            cut = text.rfind("}", 0, len(text) - 1)
            text = text[:cut + 1] if cut > 0 else ""
    return []


def read_operations(path):
    """``[{"name", "op", "dtype", "shape", "numel", "nbytes"}]`` in completion order.

    ``op`` is the prefix Horovod gives the name (``allreduce``, ``broadcast``, ``allgather``...).
    Operations whose end event carries no output shape are left out: in Horovod 0.28.1 (Gloo) those
    are a broadcast rooted at the rank writing the timeline and every alltoall (their ``E`` events
    have no ``args``); none of this project's compressors uses alltoall.
    """
    with open(path) as f:
        text = f.read().strip().rstrip(",")
    events = _events(text)
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("name") == "process_name" and "name" in e.get("args", {})}
    ops = []
    for e in events:
        args = e.get("args", {})
        if e.get("ph") != "E" or "shape" not in args or e.get("pid") not in names:
            continue
        shape = [int(s) for s in args["shape"].strip("[]").split(",") if s.strip()]
        numel = 1
        for s in shape:
            numel *= s
        name = names[e["pid"]]
        ops.append({"name": name, "op": name.split(".", 1)[0], "dtype": args["dtype"], "shape": shape,
                    "numel": numel, "nbytes": numel * _ITEMSIZE.get(args["dtype"], 0)})
    return ops
