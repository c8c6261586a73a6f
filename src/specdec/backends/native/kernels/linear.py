"""What every linear layer of the native backend offers (`Linear`), and the wrappers the model
builds from layers: `FusedLinear` (several matrices over one input, as one call where they can
be), `PromptSame` / `PromptView` (which kernel a prompt runs). The layers themselves live in
precisions.py (float checkpoints), int8_blocks.py, int4_blocks.py, int8_ort.py and
gguf/layers.py (GGUF tensors)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from specdec.backends.native.kernels.cpu import disable_marked_in_graphs
from specdec.backends.native.kernels.precisions import make_linear


@runtime_checkable
class Linear(Protocol):
    """x [M, K] -> y [M, N], each row computed on its own (the model's contract with a kernel:
    a row's bits depend neither on the other rows nor on the thread count)."""

    out_features: int  # N
    act_dtype: torch.dtype  # the dtype the kernel takes its input in (the norms write it directly)

    def forward(self, x: torch.Tensor) -> torch.Tensor: ...


class FusedLinear(torch.nn.Module):
    """Linears that read the same input (q/k/v, gate/up): one matmul over the stacked weights,
    split after, so a layer makes fewer kernel calls. fp32 keeps separate matmuls on the
    original tensors (stacking would copy them), as do layers a loader already quantized."""

    def __init__(self, weights: list, biases: list, precision: str):
        super().__init__()
        self.sizes = [w.out_features if not isinstance(w, torch.Tensor) else w.shape[0] for w in weights]
        if precision == "fp32" or not all(isinstance(w, torch.Tensor) for w in weights):
            self.parts = torch.nn.ModuleList([w if not isinstance(w, torch.Tensor)
                                              else make_linear(w, b, precision)
                                              for w, b in zip(weights, biases, strict=True)])
            self.fused = None
        else:
            bias = None
            if any(b is not None for b in biases):
                bias = torch.cat([torch.zeros(n) if b is None else b.float().cpu()
                                  for b, n in zip(biases, self.sizes, strict=True)])
                bias = bias.to(weights[0].device)
            self.fused = make_linear(torch.cat([w.detach() for w in weights]), bias, precision)
        self.act_dtype = getattr(self.fused if self.fused is not None else self.parts[0], "act_dtype",
                                 torch.float32)

    @classmethod
    def from_layers(cls, layers: list, sizes: list[int]) -> FusedLinear:
        """Over layers built elsewhere (e.g. from GGUF blocks): one layer whose output holds the
        parts side by side (fused), or one layer per part."""
        if sum(layer.out_features for layer in layers) != sum(sizes):
            raise ValueError(f"layers of {[layer.out_features for layer in layers]} rows "
                             f"for parts of {sizes}")
        fused = cls.__new__(cls)
        torch.nn.Module.__init__(fused)
        fused.sizes = list(sizes)
        if len(layers) == 1 and len(sizes) > 1:
            fused.fused, fused.parts = layers[0], None
        else:
            fused.fused, fused.parts = None, torch.nn.ModuleList(layers)
        fused.act_dtype = layers[0].act_dtype
        return fused

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:  # [M, K] -> [M, N_i] for each part
        if self.fused is None:
            return [part.forward(x) for part in self.parts]
        return list(self.fused.forward(x).split(self.sizes, dim=-1))

    def joined(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, sum N_i], the parts side by side
        if self.fused is None:
            return torch.cat([part.forward(x) for part in self.parts], dim=-1)
        return self.fused.forward(x)


class PromptSame(torch.nn.Module):
    """A layer whose prompt kernel is its decode kernel."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.layer, self.out_features, self.act_dtype = layer, layer.out_features, layer.act_dtype
        self.rebind()

    def rebind(self) -> None:
        """forward is the layer's own bound method (no extra frame per call), bound again once
        cpu.disable_marked_in_graphs has wrapped the layer's class for a compile."""
        self.forward = self.prompt_forward = self.layer.forward


class PromptView(torch.nn.Module):
    """A layer's prompt kernel as its forward (same buffers)."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.layer, self.out_features, self.act_dtype = layer, layer.out_features, layer.act_dtype
        self.forward = layer.prompt_forward


def prompt_view(linear):
    """The same layer (or FusedLinear) running its prompt kernels, for a prompt stack of layers."""
    if isinstance(linear, FusedLinear):
        if linear.fused is not None:
            return FusedLinear.from_layers([PromptView(linear.fused)], linear.sizes)
        return FusedLinear.from_layers([PromptView(p) for p in linear.parts], linear.sizes)
    return PromptView(linear)


def bind_for_graphs(modules) -> None:
    """Before a first torch.compile over `modules`: the marked layer methods become the wrappers
    that compiled graphs call eagerly (cpu.disable_marked_in_graphs), and each PromptSame, which
    holds its layer's method bound before, binds it again."""
    disable_marked_in_graphs()
    for module in modules:
        if isinstance(module, PromptSame):
            module.rebind()
