"""A built-in zoo: profiles of well-known models computed from their architectures.

Each model is its layers in forward order, each with its parameter tensors (names and
element counts, exactly as the architecture defines them) and its forward FLOPs: per
sample for CNNs (224×224 images), per token for transformers plus an attention term per
token and context token. :func:`zoo_profile` turns a model and a device into a
:class:`~commsched.costmodel.profile.Profile`:

* forward time of a layer = its FLOPs × batch (× sequence length) / (peak × ``efficiency``);
  FLOPs count multiply-adds of matrix products and convolutions as 2 (norms,
  activations, softmax and lookups are left out: they are memory-bound and small);
  attention adds ``4·d`` FLOPs per (query, key) pair, half the pairs when causal;
* backward = 2 × forward (a gradient for the input and one for the weights);
* optimizer apply = :data:`ADAM_BYTES_PER_PARAM` bytes per parameter / HBM bandwidth
  (Adam is memory-bound);
* gradients have the element size of ``dtype`` (bf16/fp16: 2 bytes, fp32: 4);
* ``contention`` = 1: on GPUs communication runs on its own engines (NCCL's SMs are not
  modelled).

So a decoder's training FLOPs are ≈ 6·N·tokens (N parameters), plus the attention term.
"""

from __future__ import annotations

from dataclasses import dataclass

from commsched.costmodel.profile import LayerProfile, Profile, TensorSpec

__all__ = [
    "ADAM_BYTES_PER_PARAM",
    "DEVICES",
    "DTYPE_BYTES",
    "MODELS",
    "Device",
    "ZooLayer",
    "ZooModel",
    "get_device",
    "get_model",
    "list_devices",
    "list_models",
    "zoo_profile",
]

#: Bytes of memory traffic per parameter for one Adam step in mixed precision: the
#: 16 bytes of state per parameter (bf16 weight 2, bf16 gradient 2, fp32 master 4, m 4,
#: v 4: ZeRO, Rajbhandari et al. 2020) are all read, and the master, m, v and bf16
#: weight written back: 14 read + 14 written. (Pure fp32 Adam: 16 read + 12 written, the same.)
ADAM_BYTES_PER_PARAM = 28
#: Gradient element size per training dtype.
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class Device:
    """An accelerator: dense (no sparsity) peak FLOP/s per dtype and memory bandwidth (bytes/s)."""

    name: str
    peak_flops: dict[str, float]
    memory_bandwidth: float
    source: str


DEVICES: dict[str, Device] = {d.name: d for d in (
    # H100 SXM5 datasheet: BF16/FP16 tensor 989 TFLOP/s dense (1979 with sparsity),
    # FP32 67 TFLOP/s, HBM3 3.35 TB/s.
    Device("h100", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}, 3.35e12,
           "NVIDIA H100 SXM5 datasheet"),
    # H200 SXM datasheet: the H100's compute, HBM3e 4.8 TB/s.
    Device("h200", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}, 4.8e12,
           "NVIDIA H200 SXM datasheet"),
    # A100 SXM4 80 GB datasheet: BF16/FP16 tensor 312 TFLOP/s dense, FP32 19.5, HBM2e 2.039 TB/s.
    Device("a100", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}, 2.039e12,
           "NVIDIA A100 SXM4 80GB datasheet"),
    # V100 SXM2 datasheet: FP16 tensor 125 TFLOP/s, FP32 15.7, HBM2 900 GB/s; no bf16.
    Device("v100", {"fp16": 125e12, "fp32": 15.7e12}, 0.9e12,
           "NVIDIA V100 SXM2 datasheet"),
    # Rough: 2 x86 cores, AVX2 FMA (2 × 8 fp32 lanes × 2 FLOPs per cycle) at ~3 GHz ≈ 0.2
    # TFLOP/s peak, for every dtype (no native bf16 math); ~20 GB/s memory. Stated, not measured.
    Device("cpu", {"bf16": 2e11, "fp16": 2e11, "fp32": 2e11}, 20e9,
           "rough: 2 AVX2 cores at 3 GHz, not measured"),
)}


@dataclass(frozen=True)
class ZooLayer:
    """One layer: its parameter tensors ``(name, elements)``, its forward FLOPs per sample
    (CNN) or per token (transformer), and attention FLOPs per token and context token."""

    name: str
    tensors: tuple[tuple[str, int], ...]
    flops: float
    attn_flops_per_ctx: float = 0.0

    @property
    def params(self) -> int:
        return sum(numel for _, numel in self.tensors)


@dataclass(frozen=True)
class ZooModel:
    """A model of the zoo. ``sequence``: a transformer (FLOPs per token, ``seq_len`` tokens per
    sample; ``causal`` halves the attention pairs); otherwise FLOPs are per sample."""

    name: str
    layers: tuple[ZooLayer, ...]
    batch_size: int
    seq_len: int | None
    causal: bool
    published_params: float
    description: str
    #: the tensors that are a tied embedding (input lookup and output projection): ``Profile.tied``
    tied: tuple[str, ...] = ()

    @property
    def sequence(self) -> bool:
        return self.seq_len is not None

    @property
    def params(self) -> int:
        """Parameter elements (tied weights counted once)."""
        return sum(layer.params for layer in self.layers)

    def layer_forward_flops(self, layer: ZooLayer, seq_len: int | None = None) -> float:
        """Forward FLOPs of ``layer`` for one sample."""
        if not self.sequence:
            return layer.flops
        s = seq_len or self.seq_len
        pairs_per_token = (s + 1) / 2 if self.causal else s
        return s * (layer.flops + layer.attn_flops_per_ctx * pairs_per_token)

    def forward_flops(self, seq_len: int | None = None) -> float:
        """Forward FLOPs of one sample (``seq_len`` tokens for a transformer)."""
        return sum(self.layer_forward_flops(layer, seq_len) for layer in self.layers)


# ------------------------------------------------------------------ CNNs (224×224 input)
def _conv(name: str, cin: int, cout: int, k: int, out_hw: int, *, bias: bool, bn: bool) -> ZooLayer:
    tensors = [(f"{name}.weight", cin * cout * k * k)]
    if bias:
        tensors.append((f"{name}.bias", cout))
    if bn:  # the BatchNorm after the convolution: its scale and shift
        tensors += [(f"{name}.bn.weight", cout), (f"{name}.bn.bias", cout)]
    return ZooLayer(name, tuple(tensors), 2.0 * cin * cout * k * k * out_hw * out_hw)


def _linear(name: str, fin: int, fout: int, *, bias: bool = True) -> ZooLayer:
    tensors = [(f"{name}.weight", fin * fout)] + ([(f"{name}.bias", fout)] if bias else [])
    return ZooLayer(name, tuple(tensors), 2.0 * fin * fout)


def _resnet50() -> ZooModel:
    """torchvision ``resnet50`` (v1.5: the stride on the 3×3 convolution); 25,557,032 parameters."""
    layers = [_conv("conv1", 3, 64, 7, 112, bias=False, bn=True)]
    cin, hw = 64, 56  # after the stride-2 7×7 and the max-pool
    for stage, (width, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3)), start=1):
        for block in range(blocks):
            stride = 2 if block == 0 and stage > 1 else 1
            out_hw = hw // stride
            p = f"layer{stage}.{block}"
            layers += [_conv(f"{p}.conv1", cin, width, 1, hw, bias=False, bn=True),
                       _conv(f"{p}.conv2", width, width, 3, out_hw, bias=False, bn=True),
                       _conv(f"{p}.conv3", width, 4 * width, 1, out_hw, bias=False, bn=True)]
            if block == 0:
                layers.append(_conv(f"{p}.downsample", cin, 4 * width, 1, out_hw, bias=False, bn=True))
            cin, hw = 4 * width, out_hw
    layers.append(_linear("fc", 2048, 1000))
    return ZooModel("resnet50", tuple(layers), batch_size=128, seq_len=None, causal=False,
                    published_params=25.6e6, description="ResNet-50 v1.5, ImageNet 224×224 (He et al. 2016)")


def _vgg16() -> ZooModel:
    """torchvision ``vgg16`` (no batch norm); 138,357,544 parameters."""
    layers, cin, hw = [], 3, 224
    for i, width in enumerate((64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
                               512, 512, 512, "M")):
        if width == "M":
            hw //= 2
            continue
        layers.append(_conv(f"features.{i}", cin, width, 3, hw, bias=True, bn=False))
        cin = width
    layers += [_linear("classifier.0", 512 * 7 * 7, 4096), _linear("classifier.3", 4096, 4096),
               _linear("classifier.6", 4096, 1000)]
    return ZooModel("vgg16", tuple(layers), batch_size=64, seq_len=None, causal=False,
                    published_params=138e6, description="VGG-16, ImageNet 224×224 (Simonyan & Zisserman 2014)")


# -------------------------------------------------------------------------- transformers
@dataclass(frozen=True)
class _Shape:
    layers: int
    d: int
    ffn: int
    vocab: int
    heads: int
    kv_heads: int
    positions: int = 0  # learned position embeddings (0: rotary)
    token_types: int = 0
    norm_bias: bool = True  # LayerNorm (weight and bias) or RMSNorm (weight only)
    linear_bias: bool = True
    gated: bool = False  # SwiGLU: gate, up, down
    tied: bool = True  # the output projection is the input embedding
    embed_norm: bool = False  # a norm after the embeddings (post-norm BERT) ...
    final_norm: bool = True  # ... or one before the output projection (pre-norm decoders)


def _norm(name: str, d: int, bias: bool) -> list[tuple[str, int]]:
    return [(f"{name}.weight", d)] + ([(f"{name}.bias", d)] if bias else [])


def _matmul(name: str, fin: int, fout: int, bias: bool) -> list[tuple[str, int]]:
    return [(f"{name}.weight", fin * fout)] + ([(f"{name}.bias", fout)] if bias else [])


def _block(i: int, s: _Shape) -> ZooLayer:
    """One pre- or post-norm transformer block (the order of its tensors does not matter here)."""
    head_dim = s.d // s.heads
    kv = s.kv_heads * head_dim
    p, b = f"layers.{i}", s.linear_bias
    tensors = _norm(f"{p}.attn_norm", s.d, s.norm_bias)
    tensors += (_matmul(f"{p}.attn.q", s.d, s.d, b) + _matmul(f"{p}.attn.k", s.d, kv, b)
                + _matmul(f"{p}.attn.v", s.d, kv, b) + _matmul(f"{p}.attn.o", s.d, s.d, b))
    tensors += _norm(f"{p}.ffn_norm", s.d, s.norm_bias)
    if s.gated:
        tensors += (_matmul(f"{p}.ffn.gate", s.d, s.ffn, b) + _matmul(f"{p}.ffn.up", s.d, s.ffn, b)
                    + _matmul(f"{p}.ffn.down", s.ffn, s.d, b))
    else:
        tensors += _matmul(f"{p}.ffn.up", s.d, s.ffn, b) + _matmul(f"{p}.ffn.down", s.ffn, s.d, b)
    matmul = sum(n for name, n in tensors if name.endswith(".weight") and (".attn." in name or ".ffn." in name))
    # Q·Kᵀ and attention·V: 2·d FLOPs each per (query, key) pair, over all query heads.
    return ZooLayer(p, tuple(tensors), 2.0 * matmul, attn_flops_per_ctx=4.0 * s.d)


def _transformer(s: _Shape, head: tuple[ZooLayer, ...] = ()) -> list[ZooLayer]:
    embed = [("embed.tokens.weight", s.vocab * s.d)]
    if s.positions:
        embed.append(("embed.positions.weight", s.positions * s.d))
    if s.token_types:
        embed.append(("embed.token_types.weight", s.token_types * s.d))
    if s.embed_norm:
        embed += _norm("embed.norm", s.d, s.norm_bias)
    layers = [ZooLayer("embed", tuple(embed), 0.0)]  # a lookup: no FLOPs
    layers += [_block(i, s) for i in range(s.layers)]
    layers += list(head)
    out = _norm("final_norm", s.d, s.norm_bias) if s.final_norm else []
    if not s.tied:
        out += _matmul("lm_head", s.d, s.vocab, False)
    # the output projection runs for every token whether or not its weight is the embedding's
    layers.append(ZooLayer("final", tuple(out), 2.0 * s.d * s.vocab))
    return layers


def _bert_large() -> ZooModel:
    """BERT-large, uncased, with the pre-training heads' pooler and MLM transform (the MLM
    decoder is tied to the embedding; its output bias is in ``final``): ≈ 336 M parameters."""
    s = _Shape(layers=24, d=1024, ffn=4096, vocab=30522, heads=16, kv_heads=16, positions=512, token_types=2,
               embed_norm=True, final_norm=False)  # post-norm: each block's two norms follow its sublayers
    head = (ZooLayer("pooler", tuple(_matmul("pooler.dense", s.d, s.d, True)), 0.0),  # first token only: ~0
            ZooLayer("mlm.transform", tuple(_matmul("mlm.transform.dense", s.d, s.d, True)
                                            + _norm("mlm.transform.norm", s.d, True)), 2.0 * s.d * s.d))
    layers = _transformer(s, head)
    final = layers[-1]
    layers[-1] = ZooLayer(final.name, final.tensors + (("mlm.decoder.bias", s.vocab),), final.flops)
    return ZooModel("bert-large", tuple(layers), batch_size=32, seq_len=128, causal=False,
                    published_params=336e6, description="BERT-large (Devlin et al. 2019), MLM on every token",
                    tied=("embed.tokens.weight",))


def _gpt2_xl() -> ZooModel:
    """GPT-2 XL: 48 layers, d 1600, 25 heads, vocab 50257, 1024 positions, tied output; 1,557,611,200."""
    s = _Shape(layers=48, d=1600, ffn=6400, vocab=50257, heads=25, kv_heads=25, positions=1024)
    return ZooModel("gpt2-xl", tuple(_transformer(s)), batch_size=8, seq_len=1024, causal=True,
                    published_params=1.5576e9, description="GPT-2 XL (Radford et al. 2019)",
                    tied=("embed.tokens.weight",))


def _llama(name: str, layers: int, d: int, ffn: int, heads: int, kv_heads: int, batch: int,
           published: float) -> ZooModel:
    s = _Shape(layers=layers, d=d, ffn=ffn, vocab=32000, heads=heads, kv_heads=kv_heads, norm_bias=False,
               linear_bias=False, gated=True, tied=False)
    return ZooModel(name, tuple(_transformer(s)), batch_size=batch, seq_len=4096, causal=True,
                    published_params=published,
                    description=f"a Llama-2-shaped decoder: {layers} layers, d {d}, SwiGLU {ffn}, "
                                f"{heads} heads / {kv_heads} KV heads, vocab 32000, context 4096 (Touvron et al. 2023)")


_BUILDERS = {
    "resnet50": _resnet50,
    "vgg16": _vgg16,
    "bert-large": _bert_large,
    "gpt2-xl": _gpt2_xl,
    "gpt-7b": lambda: _llama("gpt-7b", 32, 4096, 11008, 32, 32, batch=2, published=6.74e9),
    "gpt-70b": lambda: _llama("gpt-70b", 80, 8192, 28672, 64, 8, batch=1, published=68.98e9),
}
#: The zoo's models by name, built from their architectures at import (a few thousand tensors).
MODELS: dict[str, ZooModel] = {name: build() for name, build in _BUILDERS.items()}


def list_models() -> list[str]:
    """Names of the zoo's models."""
    return sorted(MODELS)


def list_devices() -> list[str]:
    """Names of the zoo's devices."""
    return sorted(DEVICES)


def get_model(name: str) -> ZooModel:
    """The zoo model ``name``; ``ValueError`` listing the known ones otherwise."""
    try:
        return MODELS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown model {name!r}; the zoo has: {', '.join(list_models())}") from None


def get_device(name: str) -> Device:
    """The device ``name``; ``ValueError`` listing the known ones otherwise."""
    try:
        return DEVICES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown device {name!r}; known: {', '.join(list_devices())}") from None


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return value


def zoo_profile(model: str, device: str = "h100", *, batch_size: int | None = None, seq_len: int | None = None,
                dtype: str = "bf16", efficiency: float = 0.4, tp: int = 1, pp: int = 1) -> Profile:
    """The :class:`Profile` of one data-parallel rank training ``model`` on ``device``.

    Per layer (forward order): forward = FLOPs(layer) × ``batch_size`` / (peak[dtype] ×
    ``efficiency``), backward = 2 × forward, apply = params × ADAM_BYTES_PER_PARAM /
    memory bandwidth, gradients of ``DTYPE_BYTES[dtype]`` bytes per element. ``seq_len``
    applies to transformers only (tokens per sample). ``tp``/``pp`` (tensor and
    pipeline parallel degrees) divide every layer's parameters, gradient bytes, compute
    and apply time by ``tp·pp`` (:meth:`Profile.scaled`); the tensor- and
    pipeline-parallel communication itself (activations, pipeline bubbles) is NOT
    modelled. ``source`` is ``"zoo:<model>@<device>"``; ``meta`` records every
    assumption. Unknown names: ``ValueError`` listing the known ones.
    """
    spec, dev = get_model(model), get_device(device)
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    if dtype not in dev.peak_flops:
        raise ValueError(f"{device} has no {dtype} tensor math; use dtype in {sorted(dev.peak_flops)}")
    if not (isinstance(efficiency, (int, float)) and 0 < efficiency <= 1):
        raise ValueError(f"efficiency={efficiency!r} must be in (0, 1]: the fraction of peak FLOP/s achieved")
    batch = _positive("batch_size", spec.batch_size if batch_size is None else batch_size)
    if seq_len is not None and not spec.sequence:
        raise ValueError(f"{model} is not a sequence model; it takes no seq_len")
    seq = _positive("seq_len", seq_len) if seq_len is not None else spec.seq_len
    shards = _positive("tp", tp) * _positive("pp", pp)
    flops_per_s = dev.peak_flops[dtype] * efficiency
    element = DTYPE_BYTES[dtype]
    layers = []
    for layer in spec.layers:
        forward = spec.layer_forward_flops(layer, seq) * batch / flops_per_s
        layers.append(LayerProfile(
            name=layer.name, forward_s=forward, backward_s=2 * forward,
            apply_s=layer.params * ADAM_BYTES_PER_PARAM / dev.memory_bandwidth,
            tensors=tuple(TensorSpec(name, numel, element) for name, numel in layer.tensors)))
    source = f"zoo:{model}@{device}"
    profile = Profile(layers=tuple(layers), source=source, batch_size=batch, meta={
        "model": model, "device": device, "dtype": dtype, "efficiency": efficiency, "seq_len": seq,
        "tp": tp, "pp": pp, "params": spec.params, "params_per_rank": spec.params / shards,
        "peak_flops": dev.peak_flops[dtype], "memory_bandwidth": dev.memory_bandwidth,
        "forward_flops_per_sample": spec.forward_flops(seq),
        "assumptions": ("compute = FLOPs / (peak × efficiency); backward = 2 × forward; Adam apply = "
                        f"{ADAM_BYTES_PER_PARAM} B/param / memory bandwidth; tp/pp divide parameters and "
                        "compute, their own communication not modelled; no compute slowdown under comm")},
        tied=spec.tied, ranged=None if device == "cpu" else ())  # the runtime's ranged apply is CPU-only
    return profile if shards == 1 else profile.scaled(compute=1 / shards, grad=1 / shards, source=source)
