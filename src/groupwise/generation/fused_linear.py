"""Fused input projections for the static decode loop (FastGenerator(fuse_projections=True)).

In a decode step of N rows the layers' matrix products are short (N × hidden by hidden × out), and each is one
kernel: an attention layer's q, k and v projections read the same input three times, a gated MLP's gate and up
projections twice. Engines that own their weights (vLLM) store q|k|v and gate|up as one matrix each. Here the
policy's weights stay as they are (the optimizer, checkpoints and adapters see the model unchanged); during the
decode loop, each fused projection is computed from a copy of the concatenated weights,
    [q | k | v] = x · [W_q | W_k | W_v]ᵀ + [b_q | b_k | b_v],    [g | u] = x · [W_g | W_u]ᵀ,
refreshed from the live weights at every call. The copies cost memory: the size of the attention's input
projections plus the MLP's gate and up projections (about 0.47 GB for a 0.5 B model, 9 GB for an 8 B one).

Mechanics: for the loop's duration q_proj (gate_proj) is replaced by a module that computes the fused product,
returns its first part and leaves the others in a slot; k_proj and v_proj (up_proj) return their part when called
with the same input, and otherwise fall back to the original module. Only plain torch.nn.Linear projections with
ordinary tensors as weights are fused (not PEFT layers, not FSDP's sharded DTensors): other layers run unchanged.
"""

from __future__ import annotations

import contextlib

import torch


class _Slot:
    """The fused product's parts, between the first projection's call and the last's."""

    def __init__(self):
        self.x = None
        self.parts = None


class _First(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int], slot: _Slot):
        super().__init__()
        self.weight, self.bias, self.sizes, self.slot = weight, bias, sizes, slot

    def forward(self, x):
        parts = torch.nn.functional.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)
        self.slot.x, self.slot.parts = x, parts
        return parts[0]


class _Part(torch.nn.Module):
    def __init__(self, index: int, last: bool, slot: _Slot, original: torch.nn.Module):
        super().__init__()
        self.index, self.last, self.slot = index, last, slot
        self.__dict__["original"] = original  # not a submodule: the model's own layer, restored after the loop

    def forward(self, x):
        if self.slot.x is not x:  # called on another input than the fused product's
            return self.original(x)
        out = self.slot.parts[self.index]
        if self.last:
            self.slot.x = self.slot.parts = None
        return out


class _Group:
    """One module's projections `names` (e.g. q_proj, k_proj, v_proj) fused into one weight."""

    def __init__(self, owner: torch.nn.Module, names: tuple[str, ...]):
        self.owner, self.names = owner, names
        self.originals = [getattr(owner, n) for n in names]
        ws = [m.weight for m in self.originals]
        self.weight = torch.empty((sum(w.shape[0] for w in ws), ws[0].shape[1]), dtype=ws[0].dtype,
                                  device=ws[0].device)
        has_bias = any(m.bias is not None for m in self.originals)
        self.bias = self.weight.new_zeros(self.weight.shape[0]) if has_bias else None
        slot = _Slot()
        sizes = [w.shape[0] for w in ws]
        self.stand_ins = [_First(self.weight, self.bias, sizes, slot)] + [
            _Part(i, i == len(names) - 1, slot, m) for i, m in enumerate(self.originals) if i > 0]

    def refresh(self) -> None:
        start = 0
        with torch.no_grad():
            for m in self.originals:
                end = start + m.weight.shape[0]
                self.weight[start:end].copy_(m.weight)
                if m.bias is not None:  # rows of a projection without a bias stay 0 (new_zeros)
                    self.bias[start:end].copy_(m.bias)
                start = end

    def current(self) -> bool:
        """Whether the owner still holds the projections this group was built from, with weights of the fused
        weight's dtype and device (model.to() changes them in place)."""
        w = self.originals[0].weight
        return (all(getattr(self.owner, n) is m for n, m in zip(self.names, self.originals))
                and (w.dtype, w.device) == (self.weight.dtype, self.weight.device))

    def swap(self, stand_in: bool) -> None:
        for name, module in zip(self.names, self.stand_ins if stand_in else self.originals):
            setattr(self.owner, name, module)


GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _fusable(owner: torch.nn.Module, names: tuple[str, ...]) -> bool:
    mods = [getattr(owner, n, None) for n in names]
    if not all(type(m) is torch.nn.Linear for m in mods):
        return False
    ws = [m.weight for m in mods]
    return (all(type(w) is torch.nn.Parameter or type(w) is torch.Tensor for w in ws)
            and len({(w.shape[1], w.dtype, w.device) for w in ws}) == 1)


class FusedProjections:
    """The fused q/k/v and gate/up projections of `model`, for use during a decode loop (`active()`)."""

    def __init__(self, model: torch.nn.Module):
        self.groups = [_Group(owner, names) for owner in model.modules() for names in GROUPS
                       if _fusable(owner, names)]

    def __len__(self) -> int:
        return len(self.groups)

    def current(self) -> bool:
        """False once any fused projection was replaced in the model (an adapter injected, a layer swapped) or moved
        to another dtype or device: these fused weights would then be stale, and restoring the originals would undo
        the change. Build anew."""
        return all(g.current() for g in self.groups)

    def tensors(self) -> list[torch.Tensor]:
        """The fused weights and biases (for torch._dynamo.mark_static_address: a captured graph reads them in
        place, where an input it does not know as static would be copied at every replay)."""
        return [t for g in self.groups for t in (g.weight, g.bias) if t is not None]

    @contextlib.contextmanager
    def active(self):
        """Refresh the fused weights from the model's, and compute the projections fused until the block ends (the
        model's own layers are back afterwards, also when a refresh or the block raises)."""
        if not self.current():
            raise RuntimeError("the model's projections were replaced or moved since these fused projections were "
                               "built: build FusedProjections(model) again")
        for g in self.groups:
            g.refresh()
        try:
            for g in self.groups:
                g.swap(True)
            yield
        finally:
            for g in self.groups:
                g.swap(False)
