"""Models users train, for the end-to-end benchmarks, built here (nothing downloaded) with synthetic
batches: an MLP, a ResNet-18 and a small Transformer language model, each at a ``full`` size (what
the tables measure: a step takes seconds, not minutes, on one CPU thread) and a ``tiny`` one (tests).

    model = build_model("resnet18", "full")
    x, y = make_batch("resnet18", "full", batch=8, generator=torch.Generator().manual_seed(0))
    loss = task_loss(model(x), y)

- ``mlp``: ``Linear``/``ReLU`` layers of the widths given (``widths``), classifying random vectors.
- ``resnet18``: ResNet-18 (He et al. 2016) as trained on 32x32 images (CIFAR): a 3x3 stem, four
  stages of two basic blocks with 64, 128, 256 and 512 channels (stride 2 from the second stage),
  batch norm, global average pooling and a 10-way head: 11.2M parameters. ``tiny``: 4 base channels
  on 16x16 images.
- ``transformer``: a decoder-only language model: token and position embeddings, pre-norm
  Transformer layers (causal self-attention and a ReLU feed-forward layer), a final norm and an
  output projection to the vocabulary; the loss is next-token cross entropy on random tokens. Full:
  4 layers, width 256, 4 heads, feed-forward 1024, vocabulary 8192, 64 tokens: 7.4M parameters.

The same shapes in Keras 3 (for the TensorFlow frontend) are :func:`build_keras_model`.
"""

import functools

import torch
import torch.nn.functional as F

MODELS = ("mlp", "resnet18", "transformer")
SIZES = ("full", "tiny")
DEFAULT_WIDTHS = [1024, 2048, 2048, 1024, 10]  # the MLP's layer widths: 8.4M parameters
TINY_WIDTHS = [256, 256, 10]
RESNET18 = {"full": {"channels": 64, "image": 32, "classes": 10}, "tiny": {"channels": 4, "image": 16, "classes": 10}}
TRANSFORMER = {"full": {"vocabulary": 8192, "width": 256, "heads": 4, "layers": 4, "feed_forward": 1024, "tokens": 64},
               "tiny": {"vocabulary": 256, "width": 32, "heads": 2, "layers": 2, "feed_forward": 64, "tokens": 16}}


def _check(name, size):
    if name not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}, got {name!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, got {size!r}")


def mlp_widths(size, widths=None):
    return list(widths) if widths else (DEFAULT_WIDTHS if size == "full" else TINY_WIDTHS)


def make_mlp(widths):
    layers = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


class BasicBlock(torch.nn.Module):
    """Two 3x3 convolutions with batch norm and a shortcut (a strided 1x1 convolution where the shape
    changes)."""

    def __init__(self, inputs, outputs, stride):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(outputs)
        self.conv2 = torch.nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(outputs)
        self.shortcut = torch.nn.Identity() if stride == 1 and inputs == outputs else torch.nn.Sequential(
            torch.nn.Conv2d(inputs, outputs, 1, stride, bias=False), torch.nn.BatchNorm2d(outputs))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet18(torch.nn.Module):
    def __init__(self, channels=64, classes=10):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, channels, 3, 1, 1, bias=False),
                                        torch.nn.BatchNorm2d(channels), torch.nn.ReLU())
        stages, inputs = [], channels
        for i, outputs in enumerate(channels * m for m in (1, 2, 4, 8)):
            stride = 1 if i == 0 else 2
            stages += [BasicBlock(inputs, outputs, stride), BasicBlock(outputs, outputs, 1)]
            inputs = outputs
        self.stages = torch.nn.Sequential(*stages)
        self.head = torch.nn.Linear(inputs, classes)

    def forward(self, x):
        return self.head(self.stages(self.stem(x)).mean(dim=(2, 3)))


class TransformerLM(torch.nn.Module):
    def __init__(self, vocabulary, width, heads, layers, feed_forward, tokens):
        super().__init__()
        self.embed = torch.nn.Embedding(vocabulary, width)
        self.position = torch.nn.Parameter(torch.randn(tokens, width) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(width, heads, feed_forward, dropout=0.0, batch_first=True,
                                                 norm_first=True)
        self.layers = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocabulary)
        self.register_buffer("causal", torch.nn.Transformer.generate_square_subsequent_mask(tokens),
                             persistent=False)

    def forward(self, tokens):
        n = tokens.shape[1]
        h = self.embed(tokens) + self.position[:n]
        h = self.layers(h, mask=self.causal[:n, :n], is_causal=True)
        return self.head(self.norm(h))


def build_model(name, size="full", widths=None):
    """The model ``name`` (one of :data:`MODELS`) at ``size`` (``widths``: the MLP's, overriding the
    size's)."""
    _check(name, size)
    if name == "mlp":
        return make_mlp(mlp_widths(size, widths))
    if name == "resnet18":
        config = RESNET18[size]
        return ResNet18(config["channels"], config["classes"])
    return TransformerLM(**TRANSFORMER[size])


def make_batch(name, size, batch, generator, widths=None):
    """A synthetic batch ``(inputs, targets)`` for the model: random vectors and classes, random
    images and classes, or random tokens and the same tokens shifted by one (next-token targets)."""
    _check(name, size)
    if name == "mlp":
        w = mlp_widths(size, widths)
        return torch.randn(batch, w[0], generator=generator), torch.randint(0, w[-1], (batch,), generator=generator)
    if name == "resnet18":
        c = RESNET18[size]
        return (torch.randn(batch, 3, c["image"], c["image"], generator=generator),
                torch.randint(0, c["classes"], (batch,), generator=generator))
    c = TRANSFORMER[size]
    text = torch.randint(0, c["vocabulary"], (batch, c["tokens"] + 1), generator=generator)
    return text[:, :-1], text[:, 1:]


def task_loss(output, targets):
    """Cross entropy of logits (the last axis) against class or next-token targets."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1))


def describe(name, size, widths=None):
    """A phrase naming the model and its input for the benchmark's page."""
    _check(name, size)
    if name == "mlp":
        return f"an MLP of widths {mlp_widths(size, widths)} on random vectors"
    if name == "resnet18":
        c = RESNET18[size]
        return (f"ResNet-18 ({c['channels']} base channels) on random {c['image']}x{c['image']} RGB images, "
                f"{c['classes']} classes")
    c = TRANSFORMER[size]
    return (f"a Transformer language model ({c['layers']} pre-norm layers, width {c['width']}, {c['heads']} heads, "
            f"feed-forward {c['feed_forward']}, vocabulary {c['vocabulary']}) on {c['tokens']} random tokens")


# ---------------------------------------------------------------------------------------------------
# The same shapes in Keras 3 (TensorFlow backend)


def build_keras_model(name, size="full", widths=None):
    """The Keras 3 model of the same shape as :func:`build_model`'s (its layers, widths and parameter
    count; the initialisation is Keras's own), built for :func:`make_batch`'s inputs in NHWC
    (``numpy_batch`` converts)."""
    import keras

    _check(name, size)
    layers = keras.layers
    if name == "mlp":
        w = mlp_widths(size, widths)
        return keras.Sequential([layers.Input((w[0],))] + [
            layers.Dense(b, activation="relu" if i < len(w) - 2 else None) for i, b in enumerate(w[1:])])
    if name == "resnet18":
        c = RESNET18[size]
        x = inputs = keras.Input((c["image"], c["image"], 3))

        def conv_bn(x, channels, kernel, stride):
            x = layers.Conv2D(channels, kernel, stride, padding="same", use_bias=False)(x)
            return layers.BatchNormalization(epsilon=1e-5, momentum=0.9)(x)

        x = layers.ReLU()(conv_bn(x, c["channels"], 3, 1))
        inputs_channels = c["channels"]
        for i, outputs in enumerate(c["channels"] * m for m in (1, 2, 4, 8)):
            for block in range(2):
                stride = 2 if i > 0 and block == 0 else 1
                out = layers.ReLU()(conv_bn(x, outputs, 3, stride))
                out = conv_bn(out, outputs, 3, 1)
                shortcut = x if stride == 1 and inputs_channels == outputs else conv_bn(x, outputs, 1, stride)
                x = layers.ReLU()(layers.Add()([out, shortcut]))
                inputs_channels = outputs
        x = layers.GlobalAveragePooling2D()(x)
        return keras.Model(inputs, layers.Dense(c["classes"])(x))
    c = TRANSFORMER[size]
    tokens = keras.Input((c["tokens"],), dtype="int32")
    h = _KerasEmbedWithPosition(c["vocabulary"], c["width"], c["tokens"])(tokens)
    for _ in range(c["layers"]):
        a = layers.LayerNormalization(epsilon=1e-5)(h)
        a = layers.MultiHeadAttention(c["heads"], c["width"] // c["heads"])(a, a, use_causal_mask=True)
        h = layers.Add()([h, a])
        f = layers.LayerNormalization(epsilon=1e-5)(h)
        f = layers.Dense(c["width"])(layers.Dense(c["feed_forward"], activation="relu")(f))
        h = layers.Add()([h, f])
    h = layers.LayerNormalization(epsilon=1e-5)(h)
    return keras.Model(tokens, layers.Dense(c["vocabulary"])(h))


@functools.cache
def _keras_embed_class():
    import keras

    class EmbedWithPosition(keras.layers.Layer):
        """Token embedding plus a learned position embedding."""

        def __init__(self, vocabulary, width, tokens, **kwargs):
            super().__init__(**kwargs)
            self.embed = keras.layers.Embedding(vocabulary, width)
            self.position = self.add_weight(shape=(tokens, width), name="position",
                                            initializer=keras.initializers.RandomNormal(stddev=0.02))

        def call(self, tokens):
            n = keras.ops.shape(tokens)[1]
            return self.embed(tokens) + self.position[:n]

    return EmbedWithPosition


def _KerasEmbedWithPosition(*args, **kwargs):
    return _keras_embed_class()(*args, **kwargs)


def numpy_batch(name, batch):
    """``(x, y)`` of :func:`make_batch` as NumPy arrays for the Keras model (images to NHWC, tokens
    to int32)."""
    x, y = batch
    if name == "resnet18":
        x = x.permute(0, 2, 3, 1)
    x = x.numpy().astype("int32") if name == "transformer" else x.numpy()
    return x, y.numpy().astype("int32")
