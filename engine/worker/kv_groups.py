"""KV cache groups: layers grouped by attention kind, each group with block tables of its own.

A model whose layers all see the whole context has one group: every layer reads the same block table, and a
block id names that block in every layer's cache, as always. A model that interleaves sliding-window layers with
global ones (Gemma 2 and 3) gets a group for its global layers and groups for its windowed ones, so that a
windowed layer keeps blocks only for its window (vLLM's hybrid allocator, KV cache groups of equal size):

- group 0 holds the global layers; the windowed layers are cut into groups of as many layers (the last one may
  have fewer);
- the cache holds `num_slots` K/V tensors (one per layer of a group), and layer j of every group reads and writes
  slot tensor j: a block id is a page of `num_slots` layers that one group owns at a time, so every group
  allocates from one pool of pages and the KV budget counts them all.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroups:
    windows: tuple[int | None, ...]  # per group: its layers' sliding window, None for the global group
    layers: tuple[tuple[int, ...], ...]  # per group: its layers, in slot order

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_slots(self) -> int:
        """K/V tensors in the cache: the layers of the largest group."""
        return max(map(len, self.layers))

    def group_of_layer(self) -> dict[int, int]:
        return {layer: group for group, layers in enumerate(self.layers) for layer in layers}

    def slot_of_layer(self) -> dict[int, int]:
        return {layer: slot for layers in self.layers for slot, layer in enumerate(layers)}


def single_group(num_layers: int) -> KVCacheGroups:
    """Every layer in one group, each with its own slot: the cache as a model without windows has it."""
    return KVCacheGroups((None,), (tuple(range(num_layers)),))


def kv_cache_groups(layer_windows: list[int | None]) -> KVCacheGroups:
    """The groups for layers with these sliding windows (None: the layer sees its whole context).

    One group where every layer attends alike (all global, or all with the same window: a model whose every layer
    is windowed keeps the whole context, as before)."""
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        by_window.setdefault(window, []).append(layer)
    if len(by_window) == 1 or None not in by_window:
        return single_group(len(layer_windows))
    size = len(by_window[None])
    windows: list[int | None] = [None]
    layers = [tuple(by_window.pop(None))]
    for window, members in by_window.items():
        for start in range(0, len(members), size):
            windows.append(window)
            layers.append(tuple(members[start : start + size]))
    return KVCacheGroups(tuple(windows), tuple(layers))


def window_blocks(window: int, num_new_tokens: int, block_size: int) -> int:
    """The most blocks a windowed group holds for a request computing `num_new_tokens` tokens in a step: those of
    the window before the first new token, and of the new tokens (one block more where they straddle a border).
    Decoding (one new token) that is ceil(window / block_size) + 1 at most."""
    return -(-(window - 1 + num_new_tokens) // block_size) + 1


def model_kv_groups(model: object) -> KVCacheGroups | None:
    """The model's groups, where it has several (`kv_groups`: Gemma's); None for one group."""
    groups = getattr(model, "kv_groups", None)
    return groups if isinstance(groups, KVCacheGroups) and groups.num_groups > 1 else None
