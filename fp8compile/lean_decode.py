"""A decode loop that leaves the GPU no gap between steps: the lean path beside generate().

transformers' generate() on a GPU runs Python between every two decode steps: it reads a flag
back from the GPU after each step (its stopping check), which waits for the step to finish, and
only then prepares the next step's inputs and launches it. The GPU idles for all of that host
work, every token: at batch 1 about as long as an FP8 step's kernels (BENCHMARKS.md, "What sets
batch 1"). LeanDecoder decodes the same transformers model, through the same StaticCache and the
same torch.compile backend, the way gpt-fast does: one compiled function a step takes the last
tokens and returns the next ones (the model's forward, then the choice of token: greedy, or
sampling with temperature, top-k and top-p, inside the graph, so CUDA graphs replay it whole), and
the loop reads nothing back until the end, or once every `stop_every` steps when an end-of-sequence
token can end it early. The host runs ahead of the GPU, and the GPU's time per step is its kernels.

    decoder = fp8compile.LeanDecoder(model, backend="fp8", mode="reduce-overhead")
    tokens = decoder.generate(input_ids, max_new_tokens=128, attention_mask=mask, eos_token_id=2)

Greedy, `tokens` are what `model.generate(input_ids, attention_mask=mask, max_new_tokens=128,
do_sample=False, cache_implementation="static", eos_token_id=2)` returns: the prompt, then each
sequence's new tokens, padding after its end-of-sequence token (tests/test_lean_decode.py;
docs/models.md names the few architectures where they differ, and why). The
prompt runs eagerly, as generate() runs it, unless `compile_prefill` (then through its own
torch.compile with the same backend, default mode, dynamic over the prompt's length). The decoder
keeps one StaticCache per batch size and length, so a second call of the same shape reuses the
compiled step and its CUDA graphs. It takes nothing from the model's generation_config but its
pad token: greedy unless asked to sample, and none of generate()'s other logits processors
(forced tokens, penalties, minimum lengths), which it names in a warning where the model's
generation_config sets them.

A model of local shards (fp8compile.tensor_parallel.shard) decodes the same way on each rank,
its cache holding this rank's KV heads; greedy, every rank chooses the same tokens from the
gathered logits (sampling needs the same random state on every rank, as with generate()).
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import warnings
from collections.abc import Callable, Sequence

import torch

from . import ring_window, tensor_parallel


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen, in transformers' terms and order (temperature, top-k,
    top-p, then a draw): greedy (argmax) unless do_sample."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


# Vocabulary positions a program of the first stage of argmax_rows reduces.
ARGMAX_CHUNK = 2048


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of (B, V), the same indices (the first of equal maxima), in two stages:
    each chunk of ARGMAX_CHUNK positions its own max and first index, then the first chunk
    holding the row's max. Inductor reduces a row's argmax in one program, whatever its length:
    the greedy choice over Llama-3's 128256 logits took 29 us of a batch-1 decode step (H200,
    2026-11-29, benchmarks/read_limit_llama8_8_layers_h200_2026-11-29_0a51aaa.json); chunked,
    the first stage runs a program a chunk."""
    b, v = x.shape
    if v <= 2 * ARGMAX_CHUNK:
        return x.argmax(dim=-1)
    chunks = -(-v // ARGMAX_CHUNK)
    padded = torch.nn.functional.pad(x, (0, chunks * ARGMAX_CHUNK - v), value=float("-inf"))
    best, first = padded.view(b, chunks, ARGMAX_CHUNK).max(dim=-1)
    chunk = best.argmax(dim=-1, keepdim=True)
    return (chunk * ARGMAX_CHUNK + first.gather(-1, chunk)).squeeze(-1)


def choose(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """(B, vocab) logits -> (B,) next tokens. A draw is the exponential race (argmax of p / E,
    E ~ Exp(1) i.i.d., picks token i with probability p_i): no torch.multinomial, so it compiles
    into the step's graph and replays under CUDA graphs."""
    logits = logits.float()
    if not sampling.do_sample:
        return argmax_rows(logits)
    logits = logits / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p is not None and sampling.top_p < 1:
        # transformers' TopPLogitsWarper: drop the least likely tokens whose probabilities sum to
        # at most 1 - top_p; the most likely token always stays.
        ascending, order = torch.sort(logits, dim=-1)
        drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - sampling.top_p
        drop[..., -1] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(dim=-1)
    race = torch.empty_like(probs).exponential_(1)
    return argmax_rows(probs / race)


def _decode_step(model, cache, tokens, position, offsets, mask, finished, eos, pad, names, sampling, ring):
    """One decode step: the model's forward on each sequence's last token at cache `position`,
    then the next tokens; with eos, sequences already finished get `pad`, and `finished` grows.
    names: the forward's keyword for the cache, and whether it takes logits_to_keep. ring: for
    a cache with ring_window layers, the model's mask maker and their window; the step builds
    the masks and puts the sliding ones in slot order."""
    cache_name, keep = names
    more = {"logits_to_keep": 1} if keep else {}
    if ring is not None:
        make, window = ring
        made = make(cache, tokens.shape[0], tokens.device, mask, (position + offsets)[:, None])
        mask = ring_window.masks_in_ring_order(made, position, window)
    out = model(
        input_ids=tokens[:, None],
        attention_mask=mask,
        position_ids=(position + offsets)[:, None],
        cache_position=position,
        use_cache=True,
        **{cache_name: cache},
        **more,
    )
    chosen = choose(out.logits[:, -1], sampling)
    if eos is None:
        return chosen, finished
    chosen = torch.where(finished, pad, chosen)
    return chosen, finished | (chosen[:, None] == eos).any(dim=-1)


class LeanDecoder:
    """Decodes a transformers causal LM with one compiled call a step and no host sync between
    steps (module docstring). backend, mode, dynamic: torch.compile's for the decode step
    (dynamic=None: what moves between calls, such as a sliding-window cache's position, is made
    dynamic after its first recompile, as generate() compiles it); compile_prefill: the prompt
    through its own torch.compile (default mode, dynamic) instead of eagerly."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: str | Callable = "inductor",
        mode: str | None = "reduce-overhead",
        dynamic: bool | None = None,
        compile_prefill: bool = False,
    ):
        if not getattr(model, "_can_compile_fullgraph", False):
            raise ValueError(
                f"{type(model).__name__} cannot decode through a static cache (transformers marks it "
                "_can_compile_fullgraph=False); decode it with model.generate()"
            )
        self.model = model
        # Dynamo keeps compiled graphs, and its recompile limit, per code object: each decoder
        # gets its own copy of the step's, so that no model's graphs count against another's.
        step = types.FunctionType(_decode_step.__code__.replace(), _decode_step.__globals__, "_decode_step")
        self.step = torch.compile(step, backend=backend, mode=mode, dynamic=dynamic)
        self.prefill = model
        if compile_prefill:
            self.prefill = torch.compile(model, backend=backend, dynamic=True)
        # transformers 5.24 renamed past_key_values to cache (the old name deprecated)
        parameters = inspect.signature(model.forward).parameters
        self._names = (
            "cache" if "cache" in parameters else "past_key_values",
            "logits_to_keep" in parameters,
        )
        self._caches: dict[tuple, object] = {}
        self._masks = _mask_maker(model)
        asked = not_applied(getattr(model, "generation_config", None))
        if asked:
            warnings.warn(
                f"LeanDecoder: {type(model).__name__}'s generation_config asks for {', '.join(asked)}, which "
                "LeanDecoder does not apply (it chooses tokens greedily, or by temperature, top-k and top-p "
                "when asked); model.generate() applies them",
                stacklevel=2,
            )

    def cache(self, batch: int, length: int):
        """The StaticCache for `batch` sequences of up to `length` tokens, reset: one per shape,
        kept for the next call of the same shape. Its tensors are made by the first prompt, which
        runs eagerly and so makes them static addresses for the step's graph, in the shapes the
        attention layers give them (an MLA model's keys and values differ in width); with
        compile_prefill, or for a model of local shards (fp8compile.tensor_parallel), before it,
        from the config's head counts (this rank's) and width."""
        key = (batch, length)
        if key not in self._caches:
            # a model tensor_parallel.shard sharded: this rank's KV heads, whatever the
            # transformers version sizes its cache by (5.24: the first keys stored)
            kv_heads = tensor_parallel.local_kv_heads(self.model)
            if self.prefill is self.model and kv_heads is None:
                self._caches[key] = static_cache(self.model, length)
            else:
                device = next(self.model.parameters()).device
                self._caches[key] = static_cache_made_now(self.model, batch, length, device, kv_heads)
        cache = self._caches[key]
        cache.reset()
        return cache

    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        attention_mask: torch.Tensor | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        stop_every: int = 16,
        on_step: Callable[[], None] | None = None,
        cache_length: int | None = None,
    ) -> torch.Tensor:
        """(B, P) prompt token ids (left-padded where attention_mask has zeros) -> (B, P + n): the
        prompt and up to max_new_tokens new tokens each, n fewer where every sequence reached an
        end-of-sequence token sooner (whose place the others fill with pad_token_id). With
        eos_token_id, the loop reads back whether all have ended once every stop_every steps
        (0: never, every step decoded). on_step, if given, is called after each step is launched
        (bench model's CUDA-event clock). cache_length: the static cache's length, at least the
        prompt's plus max_new_tokens (the default): a caller that decodes several lengths passes
        the longest, and every call shares one cache and its compiled graphs."""
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be (batch, prompt length), got shape {tuple(input_ids.shape)}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        sampling = Sampling(do_sample, temperature, top_k, top_p)
        batch, prompt = input_ids.shape
        device = input_ids.device
        length = prompt + max_new_tokens
        if cache_length is not None:
            if cache_length < length:
                raise ValueError(
                    f"cache_length {cache_length} < prompt {prompt} + max_new_tokens {max_new_tokens}"
                )
            length = cache_length
        eos = _as_ids(eos_token_id, device)
        if eos is not None and pad_token_id is None:
            pad_token_id = self.model.generation_config.pad_token_id
            pad_token_id = int(eos[0]) if pad_token_id is None else pad_token_id
        pad = torch.full((), pad_token_id or 0, dtype=torch.long, device=device)
        cache = self.cache(batch, length)

        mask = None
        if attention_mask is not None and not bool(attention_mask.all()):
            # the whole cache's length, fixed, so every step's graph has the same shapes
            mask = torch.ones(batch, length, dtype=attention_mask.dtype, device=device)
            mask[:, :prompt] = attention_mask
        # positions count a sequence's own tokens: left padding shifts them back, so that a padded
        # sequence is positioned as it would be alone (rotary models decode the same either way;
        # docs/models.md says where transformers' generate() positions padded rows otherwise)
        if attention_mask is None:
            positions = torch.arange(prompt, device=device).expand(batch, prompt)
        else:
            positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        offsets = positions[:, -1] + 1 - prompt
        cache_name, keep = self._names
        # A hybrid model's recurrent layers read the prompt's own padding mask (generate()'s);
        # its attention layers, and the others', build theirs from the cache's whole length.
        recurrent = any(not hasattr(layer, "get_seq_length") for layer in cache.layers)
        out = self.prefill(
            input_ids=input_ids,
            attention_mask=attention_mask if recurrent and mask is not None else mask,
            position_ids=positions,
            cache_position=torch.arange(prompt, device=device),
            use_cache=True,
            **{cache_name: cache},
            **({"logits_to_keep": 1} if keep else {}),
        )
        new = torch.empty(max_new_tokens, batch, dtype=torch.long, device=device)
        new[0] = choose(out.logits[:, -1], sampling)
        del out
        finished = None
        if eos is not None:
            finished = (new[0][:, None] == eos).any(dim=-1)
        # A fill on the device, not a tensor copied from host memory: a copy from pageable memory
        # waits for the stream's work before it, here the whole prompt, and the host would
        # launch the first steps only then (a profile showed the GPU idle after that copy).
        position = torch.full((1,), prompt, dtype=torch.long, device=device)
        # A sliding-window layer of transformers' static cache keeps its position as a Python int.
        # A mask built from it inside the step gives the compiled graph's kernels an int input
        # that moves every step, and CUDA graphs are recorded once per value of an int input (on
        # the second call, a recording a step: 105 ms a step for Mistral-7B-v0.1 on an H200). Such
        # a model gets its masks built eagerly before each step, as generate() builds them, and
        # the graph takes them as tensors. That host work outlasted a batch-1 step's kernels
        # (Gemma-2-9B), so static_cache leaves such a layer only to a model whose masks
        # ring_window cannot reorder.
        eager_masks = any(
            not isinstance(layer.get_seq_length(), torch.Tensor)
            for layer in cache.layers
            if hasattr(layer, "get_seq_length")  # a hybrid model's linear-attention layers have none
        )
        # A window shorter than the cache: ring_window's layers, the masks built in the step.
        rings = [layer for layer in cache.layers if isinstance(layer, ring_window.layer_class())]
        for layer in rings:
            layer.decoding = True
        ring = (self._masks, rings[0].window) if rings else None
        steps = 1
        for i in range(1, max_new_tokens):
            step_mask = (
                self._masks(cache, batch, device, mask, position + offsets[:, None]) if eager_masks else mask
            )
            torch.compiler.cudagraph_mark_step_begin()
            chosen, finished = self.step(
                self.model,
                cache,
                new[i - 1],
                position,
                offsets,
                step_mask,
                finished,
                eos,
                pad,
                self._names,
                sampling,
                ring,
            )
            new[i].copy_(chosen)
            position.add_(1)
            steps += 1
            if on_step is not None:
                on_step()
            if eos is not None and stop_every and steps % stop_every == 0 and bool(finished.all()):
                break
        new = new[:steps].T
        if eos is not None:
            new = _pad_after_end(new, eos, pad)
            ended = (new == eos[:, None, None]).any(dim=0)
            if bool(ended.any(dim=1).all()):  # every sequence ended: keep up to the last end
                new = new[:, : int(ended.long().argmax(dim=1).max()) + 1]
        return torch.cat([input_ids, new], dim=1)


def static_cache(model, length: int):
    """transformers' StaticCache for the model, `length` tokens long, its tensors not yet made, with
    each sliding-window layer whose window holds all `length` tokens made a plain static layer,
    and shorter windows ring_window's layers where the model's masks allow it.

    A window that holds the whole sequence excludes no key, so the layers compute the same:
    both write each step's keys at the tensor position the cache keeps, and the sliding mask
    (built from the model's config, not from the layer) still applies the window. But the
    static layer gives its position to the masks as that tensor, where the sliding one gives a
    Python int that moves every step, which LeanDecoder.generate must then keep out of the
    compiled step by building its masks eagerly (tests/test_lean_decode.py pins the tokens to
    generate()'s). A shorter window keeps only its last positions: ring_window says how a ring
    of them does without the int."""
    from transformers import StaticCache
    from transformers import cache_utils

    cache = StaticCache(config=model.config, max_cache_len=length)
    sliding = getattr(cache_utils, "StaticSlidingWindowLayer", None)
    for i, layer in enumerate(cache.layers):
        if sliding is not None and type(layer) is sliding and layer.max_cache_len >= length:
            cache.layers[i] = cache_utils.StaticLayer(max_cache_len=length)
    ring_window.ring_layers(cache, model, length)
    return cache


def static_cache_made_now(model, batch: int, length: int, device, kv_heads: int | None = None):
    """A transformers StaticCache for `batch` sequences of up to `length` tokens, its tensors made
    now, outside any compiled call, from the config's head counts and width (kv_heads: a
    sharded model's per-rank count): for a prompt that runs compiled, where the cache would
    otherwise be made inside the graph and not be static addresses."""
    config = model.config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = kv_heads or getattr(config, "num_key_value_heads", None) or heads
    cache = static_cache(model, length)
    cache.early_initialization(batch, kv_heads, head_dim, model.dtype, device)
    return cache


# generate()'s logits processors that LeanDecoder does not run, with the value that leaves each off.
PROCESSORS_OFF = {
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "sequence_bias": None,
    "min_length": 0,
    "min_new_tokens": 0,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "exponential_decay_length_penalty": None,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "min_p": None,
}


def not_applied(generation_config) -> list[str]:
    """The options of a transformers GenerationConfig that generate() would apply as logits
    processors and LeanDecoder does not: those set to anything but None or their off value."""
    return [
        f"{name}={getattr(generation_config, name)!r}"
        for name, off in PROCESSORS_OFF.items()
        if getattr(generation_config, name, None) not in (None, off)
    ]


def _mask_maker(model) -> Callable:
    """(cache, batch, device, 2-D padding mask or None, (B, 1) position ids) -> the attention
    masks of one decode step, built as generate() builds them for a static cache (the model's own
    create_masks_for_generate, else transformers'), whichever keyword names its version uses."""
    from transformers import masking_utils

    make = getattr(model, "create_masks_for_generate", masking_utils.create_masks_for_generate)
    parameters = inspect.signature(make).parameters
    cache_name = "cache" if "cache" in parameters else "past_key_values"

    def masks(cache, batch, device, mask, position_ids):
        kwargs = dict(
            config=model.config,
            inputs_embeds=torch.empty((batch, 1, 0), dtype=model.dtype, device=device),
            attention_mask=mask,
            position_ids=position_ids,
            **{cache_name: cache},
        )
        if "cache_position" in parameters:
            kwargs["cache_position"] = position_ids[0]
        made = make(**kwargs)
        if isinstance(made, dict):
            return {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in made.items()}
        return made.contiguous() if isinstance(made, torch.Tensor) else made

    return masks


def _as_ids(ids, device) -> torch.Tensor | None:
    if ids is None:
        return None
    ids = [ids] if isinstance(ids, int) else list(ids)
    return torch.tensor(ids, dtype=torch.long, device=device) if ids else None


def _pad_after_end(new: torch.Tensor, eos: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """(B, n) new tokens -> the same with every token after a sequence's first end-of-sequence
    token set to pad (the step already did so for the steps it ran; this covers the first one)."""
    is_end = (new[..., None] == eos).any(dim=-1)
    after = (is_end.long().cumsum(dim=1) - is_end.long()) > 0
    return torch.where(after, pad, new)
