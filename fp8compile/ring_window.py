"""A sliding-window KV cache layer that never moves its keys: LeanDecoder's for a window shorter
than its cache.

transformers' static sliding-window layer keeps the window's keys in position order: once the
window is full, every decode step rolls the whole window one slot left and writes the new key
last, in each layer, for keys and values, through a temporary and a copy back. At batch 16 that
was 0.90 ms of an 8-layer Gemma-3-12B step on an H200, in bf16 Inductor as in FP8 (BENCHMARKS.md,
"Decode kernels in whole models"). It also keeps its position as a Python int, so LeanDecoder
built such a model's masks eagerly before each step.

The ring layer (layer_class) writes position p's key at slot p % window and leaves the others
where they are: one key written a step. Attention does not care where a key sits (the keys are
stored after their rotary embedding), only the mask must follow it: slot s holds position p -
((p - s) mod window). ring_order takes the sliding mask transformers builds over the cache's
absolute positions (its own window, causality and padding rules) and gathers each slot's column,
inside the compiled step: no int input, no mask built on the host.

The layer assumes LeanDecoder's use: reset, one prompt from position 0, then one token a step.
"""

from __future__ import annotations

import functools

import torch

# The attention implementations whose masks are tensors ring_order can reorder (flex
# attention's block masks are not).
ATTENTION = ("sdpa", "eager")
# The layer types whose masks ring_order can reorder; a model with another (chunked attention,
# compressed or indexed ones) keeps transformers' layers.
LAYER_TYPES = {"full_attention", "sliding_attention"}


@functools.cache
def layer_class() -> type:
    """RingWindowLayer, a subclass of transformers' StaticLayer, made at its first use (importing
    fp8compile imports no transformers)."""
    from transformers.cache_utils import StaticLayer

    class RingWindowLayer(StaticLayer):
        """A static cache layer of `window` slots, holding the last `window` positions of a cache
        `length` long, position p at slot p % window (module docstring)."""

        is_sliding = True

        def __init__(self, window: int, length: int):
            super().__init__(max_cache_len=window)
            self.window = window
            self.length = length
            # set by LeanDecoder once the prompt is in: from then on the masks are built for the
            # cache's positions and put in slot order by ring_order (a bool Dynamo guards as a
            # constant, where a position would be an input that moves)
            self.decoding = False

        def reset(self):
            super().reset()
            self.decoding = False

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            tokens = key_states.shape[-2]
            positions = torch.arange(tokens, device=self.device) + self.cumulative_length
            self.cumulative_length.add_(tokens)
            # the last `window` of them (a prompt longer than the window writes only those)
            kept = min(tokens, self.window)
            slots = positions[tokens - kept :] % self.window
            self.keys.index_copy_(2, slots, key_states[:, :, tokens - kept :])
            self.values.index_copy_(2, slots, value_states[:, :, tokens - kept :])
            if tokens > self.window:  # the prompt's own attention needs all of its keys
                return key_states, value_states
            return self.keys, self.values

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            """A decode step's mask spans the whole cache's positions, which ring_order gathers
            into slot order; a prompt's (from position 0) spans the slots, or its own keys where
            it is longer than the window."""
            if self.decoding:
                return self.length, 0
            return max(query_length, self.window), 0

    return RingWindowLayer


def ring_order(mask: torch.Tensor, position: torch.Tensor, window: int) -> torch.Tensor:
    """(B, 1, 1, L) mask over absolute positions for the query at `position` ((1,) tensor):
    boolean (sdpa's, True attends) or additive (eager attention's, the dtype's minimum masks)
    -> (B, 1, 1, window) over a RingWindowLayer's slots: slot s holds position
    position - ((position - s) mod window), none (masked) where that is negative."""
    slots = torch.arange(window, device=mask.device)
    held = position - torch.remainder(position - slots, window)
    taken = mask.gather(-1, held.clamp(min=0).expand(*mask.shape[:-1], window))
    if mask.dtype == torch.bool:
        return taken & (held >= 0)
    return taken.masked_fill(held < 0, torch.finfo(mask.dtype).min)


def ring_layers(cache, model, length: int) -> bool:
    """Make the transformers sliding-window layers of `cache` (a StaticCache `length` long, not
    yet used) RingWindowLayers, where their one window is shorter than `length` and the model's
    masks allow it: ATTENTION's implementations and only full and sliding layers. Whether
    they were made."""
    from transformers import cache_utils

    sliding = getattr(cache_utils, "StaticSlidingWindowLayer", None)
    config = model.config.get_text_config(decoder=True)
    types = set(getattr(config, "layer_types", None) or ())
    if (
        sliding is None
        or getattr(config, "_attn_implementation", None) not in ATTENTION
        or not types <= LAYER_TYPES
        or (not types and getattr(config, "sliding_window", None) is None)
    ):
        return False
    windows = {layer.max_cache_len for layer in cache.layers if type(layer) is sliding}
    if len(windows) != 1 or max(windows) >= length:  # one window, shorter than the cache
        return False
    for i, layer in enumerate(cache.layers):
        if type(layer) is sliding:
            cache.layers[i] = layer_class()(layer.max_cache_len, length)
    return True


def masks_in_ring_order(masks, position: torch.Tensor, window: int):
    """The masks transformers' create_masks_for_generate made for a decode step over a cache with
    RingWindowLayers (one tensor where every layer slides, else one a layer type), the sliding
    ones in slot order."""
    if isinstance(masks, dict):
        return {
            kind: ring_order(mask, position, window) if kind == "sliding_attention" else mask
            for kind, mask in masks.items()
        }
    return ring_order(masks, position, window)
