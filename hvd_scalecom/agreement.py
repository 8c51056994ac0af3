"""Framework-neutral check that every rank was configured alike.

Each rank describes its configuration as a JSON-able dict (a *summary*: the scheme's arguments plus
digests of its tensors' shapes); a frontend's transport gathers every rank's encoded summary
(``hvd_scalecom.torch.collectives.check_agreement``, ``hvd_scalecom.tensorflow.scalecom``), and
:func:`check_gathered` raises the same ValueError on every rank when they differ. Ranks that
disagree on k or on the tensor list would otherwise hang in a collective or diverge silently.
"""

import hashlib
import json

STEPS_HINT = ("(steps lists the parameters' distinct step counters, which choose the leaders: restore every "
              "rank from a state of the same step.)")
DTYPES_HINT = ("(parameter_dtypes lists the dtypes of named_parameters: a model cast to another dtype on some "
               "ranks only?)")


def digest(value):
    """A short digest of a JSON-able ``value``."""
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:16]


def shapes_digest(named_shapes):
    """A short digest of ``[(name, shape)]`` (names and shapes of the parameters, in order)."""
    return digest([[n, list(s)] for n, s in named_shapes])


def dtype_names(dtypes):
    """The distinct dtypes among ``dtypes`` as sorted names (``torch.float32`` as ``"float32"``), for a
    summary: ranks whose parameters differ in dtype alone (a model cast on some ranks only) fail in
    Horovod's allreduce without a name ("Mismatched data types"), or, where a ``value_dtype`` makes
    every rank send one dtype, train on silently in different precisions. (Names, not a digest: the
    error then shows each rank's dtypes, and a parameter list that differs does not also list them.)"""
    return sorted({str(d).rsplit(".", 1)[-1] for d in dtypes})


def encode(summary):
    """This rank's ``summary`` as bytes, the same for equal dicts whatever their key order."""
    return json.dumps(summary, sort_keys=True).encode()


def check_gathered(scheme, gathered, hints=None):
    """Raise ValueError (see :func:`describe_disagreement`) unless every rank's bytes in
    ``gathered`` (rank order) are equal."""
    texts = [bytes(chunk).decode() for chunk in gathered]
    if len(set(texts)) > 1:
        raise ValueError(describe_disagreement(scheme, texts, hints or {}))


def describe_disagreement(scheme, texts, hints):
    """The error text: the keys that differ and each rank's values; ``hints`` ``{key: sentence}``
    is added for the keys that differ."""
    summaries = [json.loads(t) for t in texts]
    keys = sorted(set().union(*summaries))
    differing = [k for k in keys if len({json.dumps(s[k]) if k in s else "(missing)" for s in summaries}) > 1]
    per_rank = "; ".join(f"rank {r}: " + ", ".join(f"{k}={s[k]!r}" if k in s else f"{k} missing" for k in differing)
                         for r, s in enumerate(summaries))
    extra = "".join(f" {hints[k]}" for k in differing if k in hints)
    return f"{scheme} is configured differently on different ranks ({', '.join(differing)} differ): " \
           f"{per_rank}.{extra}"
