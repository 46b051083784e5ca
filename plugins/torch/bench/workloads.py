"""Benchmark workloads: small models that stress communication differently.

Each workload is a model whose top-level children are its "layers" (the unit
the report times), a synthetic batch and a loss. Sizes are chosen for two
single-threaded workers on a 2-core machine and a 1 Gbit/s emulated link (the
regime each promises is ``Workload.regime``; the report says which one it measured
in, and ``commsched bench --calibrate`` picks the batch size that puts it there on
the machine at hand):

=============  ==========================================  ======================
name           model                                       regime (2 workers, 1G)
=============  ==========================================  ======================
comm-heavy     VGG-like CNN, big FC layers hold the bytes  comm >> compute
balanced       8-layer MLP                                 comm ~ compute
compute-heavy  ResNet-like CNN, few bytes                  comm already hidden
gpt2           GPT-2-style transformer, tied embeddings    comm > compute
tiny           2-layer MLP (tests only)                    startup-dominated
=============  ==========================================  ======================

``python -m commsched.plugins.torch.bench.workloads [name ...]`` prints each
workload's parameter bytes and per-layer compute time on this machine.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
import time
from collections.abc import Callable
from typing import Any
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Workload:
    """A model factory plus the synthetic batch it trains on."""

    name: str
    description: str
    build: Callable[[], nn.Module]
    make_batch: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    batch_size: int
    lr: float = 0.01
    #: the regime the name promises (``comm-bound``, ``balanced``, ``compute-bound``; see
    #: ``commsched.bench.report.regime_of``), checked against the baseline and aimed at by
    #: ``--calibrate``; ``None``: no promise (tests, user workloads)
    regime: str | None = None


# --------------------------------------------------------------------- models


class _Flatten(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1)


def _conv_block(cin: int, cout: int, pool: bool) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU()]
    if pool:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


def vgg_like(image: int = 32, classes: int = 100) -> nn.Module:
    """Three conv blocks then 2048-wide FC layers: ~90 % of bytes in the FCs."""
    feat = 128 * (image // 8) ** 2
    return nn.Sequential(
        _conv_block(3, 32, pool=True),
        _conv_block(32, 64, pool=True),
        _conv_block(64, 128, pool=True),
        _Flatten(),
        nn.Sequential(nn.Linear(feat, 2048), nn.ReLU()),
        nn.Sequential(nn.Linear(2048, 2048), nn.ReLU()),
        nn.Sequential(nn.Linear(2048, 2048), nn.ReLU()),
        nn.Linear(2048, classes),
    )


def mlp(width: int, depth: int, inputs: int, classes: int) -> nn.Module:
    """``depth`` Linear layers of ``width``, ReLU between; one child per layer."""
    layers: list[nn.Module] = [nn.Sequential(nn.Linear(inputs, width), nn.ReLU())]
    for _ in range(depth - 2):
        layers.append(nn.Sequential(nn.Linear(width, width), nn.ReLU()))
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


class _Residual(nn.Module):
    """conv-relu-conv plus skip; no normalisation (no buffers for DDP to sync)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        # Start near identity so activations stay in range without BatchNorm.
        nn.init.zeros_(self.conv2.weight)
        nn.init.zeros_(self.conv2.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.conv2(F.relu(self.conv1(x))))


def resnet_like(classes: int = 100) -> nn.Module:
    """Stem, three stages of residual blocks with stride-2 transitions, a head."""
    return nn.Sequential(
        _conv_block(3, 32, pool=False),
        _Residual(32),
        _conv_block(32, 64, pool=True),
        _Residual(64),
        _conv_block(64, 128, pool=True),
        _Residual(128),
        _conv_block(128, 256, pool=True),
        _Residual(256),
        nn.Sequential(nn.AdaptiveAvgPool2d(1), _Flatten(), nn.Linear(256, classes)),
    )


class _Embed(nn.Module):
    def __init__(self, vocab: int, dim: int, context: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(context, dim)
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.wte(idx) + self.wpe(pos)


class _Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, 4x MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class _Head(nn.Module):
    """Final norm and the output projection, tied to the input embedding."""

    def __init__(self, dim: int, embed: _Embed) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.embed_weight = embed.wte.weight  # tied: one Parameter, two uses

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.ln(x), self.embed_weight)


def gpt2_like(vocab: int, context: int, dim: int, layers: int, heads: int) -> nn.Module:
    """GPT-2 layout with tied input/output embeddings (the weight appears once
    in ``parameters()``; its gradient sums both uses and is ready only when
    backward reaches the input embedding)."""
    embed = _Embed(vocab, dim, context)
    return nn.Sequential(embed, *[_Block(dim, heads) for _ in range(layers)], _Head(dim, embed))


# -------------------------------------------------------------------- batches


def _images(size: int, classes: int) -> Callable[[int, torch.Generator], tuple]:
    def make(batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(batch, 3, size, size, generator=gen)
        return x, torch.randint(0, classes, (batch,), generator=gen)

    return make


def _vectors(dim: int, classes: int) -> Callable[[int, torch.Generator], tuple]:
    def make(batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(batch, dim, generator=gen), torch.randint(0, classes, (batch,), generator=gen)

    return make


def _tokens(vocab: int, context: int) -> Callable[[int, torch.Generator], tuple]:
    def make(batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        seq = torch.randint(0, vocab, (batch, context + 1), generator=gen)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    return make


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


_GPT = {"vocab": 16384, "context": 128, "dim": 384, "layers": 4, "heads": 6}

WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in [
        Workload(
            "comm-heavy", "VGG-like CNN on 32x32 images, 2048-wide FC layers",
            lambda: vgg_like(32, 100), _images(32, 100), F.cross_entropy, batch_size=32,
            regime="comm-bound",
        ),
        Workload(
            "balanced", "8-layer MLP, width 1536 (forward ~1/3 of compute)",
            lambda: mlp(1536, 8, 1536, 1000), _vectors(1536, 1000), F.cross_entropy,
            batch_size=512, regime="balanced",
        ),
        Workload(
            "compute-heavy", "ResNet-like CNN (no norm layers) on 32x32 images",
            lambda: resnet_like(100), _images(32, 100), F.cross_entropy, batch_size=32,
            regime="compute-bound",
        ),
        Workload(
            "gpt2", "GPT-2-style transformer, tied embeddings (vocab 16384, "
            "context 128, dim 384, 4 layers)",
            lambda: gpt2_like(**_GPT), _tokens(_GPT["vocab"], _GPT["context"]), _lm_loss,
            batch_size=4, regime="comm-bound",
        ),
        Workload(
            "tiny", "2-layer MLP for tests (a few hundred KB)",
            lambda: mlp(256, 2, 256, 10), _vectors(256, 10), F.cross_entropy, batch_size=8,
        ),
    ]
}


#: Samples per worker per step for a ``module:function`` workload that names none.
DEFAULT_BATCH_SIZE = 32

_SPEC_HELP = ("a built-in name ({names}) or module:function, where function() returns (model, make_batch, loss_fn) "
              "or (model, make_batch, loss_fn, batch_size): an nn.Module, make_batch(batch_size, generator) -> "
              "(inputs, targets) and loss_fn(outputs, targets) -> scalar")


def _user_parts(spec: str, fn: Callable[[], Any]) -> tuple[nn.Module, Callable, Callable, int]:
    """Call ``fn`` and check what it returned, naming what is wrong."""
    parts = fn()
    if not isinstance(parts, tuple) or len(parts) not in (3, 4):
        raise ValueError(f"--workload {spec}: the function returned {type(parts).__name__}"
                         f"{f' of {len(parts)} items' if isinstance(parts, tuple) else ''}; it must return "
                         "(model, make_batch, loss_fn) or (model, make_batch, loss_fn, batch_size)")
    model, make_batch, loss_fn = parts[:3]
    batch_size = parts[3] if len(parts) == 4 else DEFAULT_BATCH_SIZE
    if not isinstance(model, nn.Module):
        raise ValueError(f"--workload {spec}: the first item must be a torch.nn.Module, got {type(model).__name__}")
    for what, value in (("make_batch", make_batch), ("loss_fn", loss_fn)):
        if not callable(value):
            raise ValueError(f"--workload {spec}: {what} must be callable, got {type(value).__name__}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"--workload {spec}: the default batch size must be an int >= 1, got {batch_size!r}")
    return model, make_batch, loss_fn, batch_size


def resolve_workload(spec: str) -> Workload:
    """The workload ``spec`` names: a key of :data:`WORKLOADS`, or ``module:function``.

    ``function()`` (importable as ``module``, e.g. from the current folder or
    ``PYTHONPATH``) returns ``(model, make_batch, loss_fn)`` plus optionally a default
    batch size (else :data:`DEFAULT_BATCH_SIZE`). It is called once here to check its
    result, and again by ``Workload.build`` in each worker, so every rank builds its
    own model (commsched broadcasts rank 0's parameters). A bad spec raises
    ``ValueError`` saying what is wrong and what a spec looks like."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"--workload {spec!r}: expected " + _SPEC_HELP.format(names=", ".join(WORKLOADS)))
    if spec in WORKLOADS:
        return WORKLOADS[spec]
    if ":" not in spec:
        raise ValueError(f"unknown workload {spec!r}; give " + _SPEC_HELP.format(names=", ".join(WORKLOADS)))
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--workload {spec}: expected module:function, e.g. my_models:resnet_tiny")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--workload {spec}: cannot import {module_name!r} ({exc}); run from the folder that holds "
                         f"it or add that folder to PYTHONPATH") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"--workload {spec}: {module_name} has no function {attr!r}")
    _, make_batch, loss_fn, batch_size = _user_parts(spec, fn)
    return Workload(spec, f"{spec} (user workload)", lambda: _user_parts(spec, fn)[0], make_batch, loss_fn,
                    batch_size=batch_size)


def get_workload(name: str) -> Workload:
    """The workload called ``name`` (see :func:`resolve_workload`); ``ValueError`` lists the choices."""
    return resolve_workload(name)


def param_bytes(model: nn.Module) -> int:
    """Bytes of all (distinct) parameters, i.e. the bytes one all-reduce moves."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


# ------------------------------------------------------------------ profiling


def profile_layers(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], repeats: int = 3,
) -> list[dict]:
    """Per top-level child: parameter bytes, forward ms, gradient-ready ms.

    ``forward_ms`` is the child's own forward time (forward hooks).
    ``grad_ready_ms`` is when, counted from the start of backward, the last of
    the child's parameter gradients was accumulated: the moment a scheduler
    could start sending that layer. Medians over ``repeats`` steps after one
    warm-up step.
    """
    children = list(model.named_children())
    owner: dict[int, int] = {}
    for i, (_, child) in enumerate(children):
        for p in child.parameters():
            owner.setdefault(id(p), i)  # a tied weight belongs to its first user
    fwd: list[list[float]] = [[] for _ in children]
    ready: list[list[float]] = [[] for _ in children]
    state = {"t": 0.0, "bwd0": 0.0, "step": [0.0] * len(children)}
    handles = []

    def pre(_m: nn.Module, _inp: object) -> None:
        state["t"] = time.perf_counter()

    def post_for(i: int) -> Callable:
        def post(_m: nn.Module, _inp: object, _out: object) -> None:
            fwd[i].append((time.perf_counter() - state["t"]) * 1e3)

        return post

    def grad_for(i: int) -> Callable:
        def hook(_p: torch.Tensor) -> None:
            now = (time.perf_counter() - state["bwd0"]) * 1e3
            state["step"][i] = max(state["step"][i], now)

        return hook

    for i, (_, child) in enumerate(children):
        handles.append(child.register_forward_pre_hook(pre))
        handles.append(child.register_forward_hook(post_for(i)))
    for p in model.parameters():
        handles.append(p.register_post_accumulate_grad_hook(grad_for(owner[id(p)])))
    try:
        for rep in range(repeats + 1):
            model.zero_grad(set_to_none=True)
            state["step"] = [0.0] * len(children)
            loss = loss_fn(model(x), y)
            state["bwd0"] = time.perf_counter()
            loss.backward()
            for i in range(len(children)):
                if rep == 0:
                    fwd[i].clear()
                else:
                    ready[i].append(state["step"][i])
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    seen: set[int] = set()
    rows = []
    for i, (name, child) in enumerate(children):
        nbytes = 0
        for p in child.parameters():
            if owner[id(p)] == i and id(p) not in seen:
                seen.add(id(p))
                nbytes += p.numel() * p.element_size()
        has_params = any(owner[id(p)] == i for p in child.parameters())
        rows.append({
            "layer": f"{name}:{type(child).__name__}",
            "param_bytes": nbytes,
            "forward_ms": _median(fwd[i]),
            "grad_ready_ms": _median(ready[i]) if has_params else None,
        })
    return rows


def _median(values: list[float]) -> float:
    s = sorted(values)
    if not s:
        return math.nan
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def format_layers(rows: list[dict]) -> str:
    """The per-layer profile as a plain-text table."""
    out = [f"{'layer':<24} {'MB':>8} {'fwd ms':>8} {'grad ready ms':>14}"]
    for r in rows:
        ready = "-" if r["grad_ready_ms"] is None else f"{r['grad_ready_ms']:.1f}"
        out.append(
            f"{r['layer']:<24} {r['param_bytes'] / 1e6:8.2f} {r['forward_ms']:8.1f} {ready:>14}"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Print parameter bytes and the per-layer profile of the named workloads."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=[n for n in WORKLOADS if n != "tiny"])
    parser.add_argument("--batch-size", type=int, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for name in args.names:
        w = get_workload(name)
        torch.manual_seed(0)
        model = w.build()
        gen = torch.Generator().manual_seed(0)
        x, y = w.make_batch(args.batch_size or w.batch_size, gen)
        rows = profile_layers(model, x, y, w.loss)
        print(f"== {name}: {w.description}")
        print(f"parameters {param_bytes(model) / 1e6:.1f} MB, batch {len(x)}")
        print(format_layers(rows))
        print(f"forward {sum(r['forward_ms'] for r in rows):.0f} ms, "
              f"backward {max(r['grad_ready_ms'] or 0 for r in rows):.0f} ms")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
