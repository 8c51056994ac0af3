"""The two training tasks of the convergence benchmark: data that ships with an installed package,
the model, how each simulated worker draws its batches, and the held-out metric.

* ``digits``: scikit-learn's 8x8 handwritten digits and the examples' MLP (64-512-256-10, 167,178
  parameters); the first 1,437 images train, the last 360 test (``examples/pytorch_scalecom.py``).
  Worker i of n owns the shard ``train[i::n]`` (cut to the shortest shard's length, so that all
  shards stack; at n = 64 that drops 29 of 1,437 images) and walks through a fresh permutation of
  it every epoch. Metric: test accuracy (and test loss).
* ``charlm``: a character-level language model on the Python standard library's own source: the
  files of :data:`STDLIB_FILES`, read in that (sorted) order from ``sysconfig.get_paths()['stdlib']``
  and concatenated; the first :data:`TRAIN_CHARS` characters train, the next :data:`VALID_CHARS`
  validate (they come from the last files of the list, which training never sees). Characters map to
  a 97-symbol vocabulary (newline, printable ASCII, one symbol for everything else). The model reads
  the previous :data:`CONTEXT` characters: embedding (16 per character) -> 256 ReLU -> 97 logits
  (Bengio et al.'s neural LM with a window). Every worker draws its windows uniformly from the whole
  training text (i.i.d. workers, as for digits). Metric: validation loss in nats and bits per
  character, on every :data:`VALID_STRIDE`-th validation window.

Every sampler is seeded by ``(seed, n)`` alone, so at a given n all schemes see the same batches.
"""

import math
import os
import sysconfig

import torch

# Modules present as single files in every CPython from 3.9 to 3.13, sorted by name.
STDLIB_FILES = (
    "abc.py", "argparse.py", "ast.py", "base64.py", "bisect.py", "calendar.py", "cmd.py", "codecs.py",
    "colorsys.py", "configparser.py", "contextlib.py", "copy.py", "csv.py", "dataclasses.py",
    "difflib.py", "enum.py", "fnmatch.py", "fractions.py", "functools.py", "getopt.py", "gettext.py",
    "glob.py", "gzip.py", "heapq.py", "hmac.py", "inspect.py", "ipaddress.py", "keyword.py",
    "linecache.py", "locale.py", "numbers.py", "operator.py", "optparse.py", "os.py", "pprint.py",
    "queue.py", "random.py", "reprlib.py", "sched.py", "secrets.py", "shlex.py", "shutil.py",
    "statistics.py", "string.py", "subprocess.py", "tempfile.py", "textwrap.py", "threading.py",
    "timeit.py", "tokenize.py", "trace.py", "traceback.py", "types.py", "typing.py", "uuid.py",
    "warnings.py", "weakref.py",
)
TRAIN_CHARS = 600_000
VALID_CHARS = 60_000
CONTEXT = 24
VALID_STRIDE = 6
VOCAB = 97  # 0: newline, 1..95: ASCII 32..126, 96: anything else


class Task:
    """A task: ``model(seed)``, ``loss``, ``sampler(n, batch, seed)`` and ``evaluate(model)``.

    ``metric`` names the figure ``evaluate`` reports first (``higher_is_better`` says which way is
    better); ``describe()`` is stored in the results JSON.
    """

    name = "task"
    metric = "metric"
    higher_is_better = True

    @staticmethod
    def loss(output, target):
        return torch.nn.functional.cross_entropy(output, target)

    def describe(self):
        return {"name": self.name}


# -- digits ---------------------------------------------------------------------------------------------

def digits_split():
    """Standardised digits as the example uses them: 1,437 training and 360 test images."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0 - 0.5) / 0.5
    return (torch.tensor(x[:1437], dtype=torch.float32), torch.tensor(y[:1437]),
            torch.tensor(x[1437:], dtype=torch.float32), torch.tensor(y[1437:]))


def digits_mlp():
    return torch.nn.Sequential(
        torch.nn.Linear(64, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 10))


class ShardSampler:
    """Worker i walks through permutations of its shard ``x[i::n]`` (cut to equal lengths)."""

    def __init__(self, x, y, n, batch, seed):
        size = len(x) // n
        if size < batch:
            raise ValueError(f"{n} shards of {size} examples cannot give batches of {batch}")
        self.x = torch.stack([x[i::n][:size] for i in range(n)])          # (n, size, ...)
        self.y = torch.stack([y[i::n][:size] for i in range(n)])
        self.n, self.size, self.batch = n, size, batch
        self.generator = torch.Generator().manual_seed(1_000_003 * seed + n)
        self.position = size  # a fresh permutation at the first call

    def __call__(self):
        if self.position + self.batch > self.size:
            self.order = torch.rand(self.n, self.size, generator=self.generator).argsort(dim=1)
            self.position = 0
        take = self.order[:, self.position:self.position + self.batch]
        self.position += self.batch
        rows = torch.arange(self.n).unsqueeze(1)
        return self.x[rows, take], self.y[rows, take]


class Digits(Task):
    name = "digits"
    metric = "accuracy"
    higher_is_better = True

    def __init__(self):
        self.x_train, self.y_train, self.x_test, self.y_test = digits_split()

    def model(self, seed):
        torch.manual_seed(seed)
        return digits_mlp()

    def sampler(self, n, batch, seed):
        return ShardSampler(self.x_train, self.y_train, n, batch, seed)

    def evaluate(self, model):
        with torch.no_grad():
            out = model(self.x_test)
            return {"accuracy": float((out.argmax(dim=1) == self.y_test).float().mean()),
                    "test_loss": float(self.loss(out, self.y_test))}

    def describe(self):
        return {"name": self.name, "train": len(self.x_train), "test": len(self.x_test),
                "model": "MLP 64-512-256-10, ReLU",
                "parameters": sum(p.numel() for p in self.model(0).parameters())}


# -- character-level language model ------------------------------------------------------------------

def encode(text):
    """Characters to ids: newline 0, ASCII 32..126 to 1..95, anything else 96."""
    codes = torch.tensor(list(text.encode("utf-32-le")), dtype=torch.uint8).view(torch.int32).long()
    ids = torch.full_like(codes, VOCAB - 1)
    printable = (codes >= 32) & (codes <= 126)
    ids[printable] = codes[printable] - 31
    ids[codes == 10] = 0
    return ids


def stdlib_text(chars=TRAIN_CHARS + VALID_CHARS):
    """The first ``chars`` characters of :data:`STDLIB_FILES` concatenated, and the files used."""
    root = sysconfig.get_paths()["stdlib"]
    parts, used, total = [], [], 0
    for name in STDLIB_FILES:
        path = os.path.join(root, name)
        if not os.path.exists(path):
            raise FileNotFoundError(f"the corpus needs {path} (the standard library's {name})")
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        parts.append(text)
        used.append(name)
        total += len(text)
        if total >= chars:
            break
    if total < chars:
        raise ValueError(f"the listed standard-library files hold {total:,} characters, {chars:,} needed")
    return "".join(parts)[:chars], used


class CharMLP(torch.nn.Module):
    """Embedding of the last CONTEXT characters -> one hidden ReLU layer -> next-character logits."""

    def __init__(self, context=CONTEXT, embedding=16, hidden=256):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, embedding)
        self.hidden = torch.nn.Linear(context * embedding, hidden)
        self.out = torch.nn.Linear(hidden, VOCAB)

    def forward(self, ids):
        e = self.embed(ids).flatten(start_dim=-2)
        return self.out(torch.relu(self.hidden(e)))


class WindowSampler:
    """Every worker draws ``batch`` windows uniformly from the training text (i.i.d. workers)."""

    def __init__(self, windows, n, batch, seed):
        self.windows, self.n, self.batch = windows, n, batch
        self.generator = torch.Generator().manual_seed(1_000_003 * seed + n)

    def __call__(self):
        at = torch.randint(len(self.windows), (self.n, self.batch), generator=self.generator)
        w = self.windows[at]
        return w[..., :-1], w[..., -1]


class CharLM(Task):
    name = "charlm"
    metric = "valid_loss"
    higher_is_better = False

    def __init__(self):
        text, self.files = stdlib_text()
        ids = encode(text)
        self.train_ids, self.valid_ids = ids[:TRAIN_CHARS], ids[TRAIN_CHARS:]
        self.train_windows = self.train_ids.unfold(0, CONTEXT + 1, 1)         # (positions, CONTEXT + 1)
        valid = self.valid_ids.unfold(0, CONTEXT + 1, 1)[::VALID_STRIDE]
        self.valid_x, self.valid_y = valid[:, :-1], valid[:, -1]

    def model(self, seed):
        torch.manual_seed(seed)
        return CharMLP()

    def sampler(self, n, batch, seed):
        return WindowSampler(self.train_windows, n, batch, seed)

    def evaluate(self, model):
        with torch.no_grad():
            loss = float(self.loss(model(self.valid_x), self.valid_y))
        return {"valid_loss": loss, "bits_per_char": loss / math.log(2)}

    def describe(self):
        import sys
        return {"name": self.name, "python": sys.version.split()[0], "files": self.files,
                "first_file": self.files[0], "last_file": self.files[-1],
                "train_chars": TRAIN_CHARS, "valid_chars": VALID_CHARS, "context": CONTEXT,
                "valid_windows": len(self.valid_y), "vocabulary": VOCAB,
                "model": f"embedding {VOCAB}x16 -> {CONTEXT * 16}-256 ReLU -> {VOCAB}",
                "parameters": sum(p.numel() for p in CharMLP().parameters())}


TASKS = {"digits": Digits, "charlm": CharLM}
