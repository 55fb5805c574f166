"""Batched decoding for many conversations at once: a static KV cache with one row per
conversation, and on CUDA a decode step replayed as one CUDA graph.

Every in-process model of the project generates here: GRPO's episodes of a step, the policies
evaluated in process (base, adapters, router, MoE) and the OpenAI-compatible server for GPU runs.

- **Rows.** The cache holds `rows` conversations of up to `max_len` tokens. A request whose
  tokens extend a row's tokens continues that row (a multi-turn episode pays each token once);
  a new request takes the least recently used row and first copies the longest common prefix of
  another row (a shared system prompt is computed once per engine, not once per episode).
- **One write column.** Every forward writes the same columns for all rows; a row with fewer
  new tokens is left-padded and its holes are masked. Positions count a row's real tokens, so
  a row's keys do not depend on the columns they sit in: copying and compacting columns is exact.
- **Decode.** Sampling (Gumbel-max at each row's temperature, argmax at 0), the stop test and the
  bookkeeping run on the GPU inside the step, so a step is one graph replay; the host looks at
  the rows every few steps only. On the CPU the same step runs eagerly.

- **Grammar.** A request with a matcher (models/grammar.py) samples only tokens its JSON schema
  allows: the host advances the matchers and refills a bitmask after every step, the step applies it.
  A batch with no matcher runs as above, with no host round trip per token.

Weights that change (a GRPO step, a different adapter) make cached keys stale: call `reset()`.
Rows carry a `tag` (e.g. the adapter a conversation is routed to): prefixes are shared only
between rows of the same tag, and `before_forward(tags)` lets a model route rows by tag.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from trace_rl.models.llama_server import common_prefix
from trace_rl.models.fuse import fuse_projections

ATTENTION = "trace_rl_rows"  # the attention implementation registered below
MIN_SHARED_PREFIX = 16
SLACK = 8  # columns past max_len that only warm-up steps before a graph capture may write


@dataclass
class Request:
    ids: list[int]
    max_new: int
    temperature: float = 0.0
    tag: int = 0
    grammar: object | None = None  # a matcher (models/grammar.py): the reply is held to its schema


def stop_ids(tokenizer) -> list[int]:
    """Token ids that end an assistant turn (eos, and <|im_end|> where the template uses it)."""
    ids = {tokenizer.eos_token_id}
    for tok in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
        i = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(i, int) and i != tokenizer.unk_token_id:
            ids.add(i)
    return sorted(i for i in ids if i is not None)


# ---------------------------------------------------------------- attention over the row cache
def _row_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention for the engine's forwards (kwargs carry `rows_engine=True`), else plain SDPA.

    Decoding a single token with grouped-query heads, the query heads are packed per key/value
    head, so the cache is read as it is: no copy of keys and values per query head (what SDPA
    with a mask would need), which at long contexts costs more than the weights."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if not kwargs.pop("rows_engine", False):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    b, hq, t, d = query.shape
    hkv = key.shape[1]
    if t == 1 and hq != hkv:
        q = query.reshape(b, hkv, hq // hkv, d)  # query heads j*n .. j*n+n-1 share key/value head j
        if torch.compiler.is_compiling():  # written out, inductor fuses it with its neighbours (faster)
            w = (q @ key.transpose(-1, -2)).float() * (scaling or d ** -0.5)
            out = w.masked_fill(~attention_mask, float("-inf")).softmax(-1).to(value.dtype) @ value
        else:  # one kernel; in a CUDA graph as fast as the written-out form
            out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, scale=scaling)
        return out.reshape(b, hq, 1, d).transpose(1, 2), None
    if hq != hkv:
        key, value = repeat_kv(key, hq // hkv), repeat_kv(value, hq // hkv)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling)
    return out.transpose(1, 2), None


def _use_row_attention(model) -> None:
    """Route the model's attention through `_row_attention` (plain SDPA, masks included, for
    every forward that is not the engine's)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(ATTENTION, _row_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    for m in model.modules():  # whatever it was (flash attention ignores a 4D mask): ours, SDPA underneath
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = ATTENTION


def _hf_model(model):
    """The transformers model under a peft or MoE wrapper."""
    while True:
        if type(model).__name__ == "LoRAMoE":
            model = model.model
        elif hasattr(model, "get_base_model"):
            model = model.get_base_model()
        else:
            return model


def _argmax(scores: torch.Tensor, chunks: int = 128) -> torch.Tensor:
    """Argmax over the last dimension in two stages: a row's 150k logits reduced by one thread block
    take a large share of a decode step; in `chunks` pieces they spread over the GPU."""
    rows, v = scores.shape
    if v % chunks:
        scores = torch.nn.functional.pad(scores, (0, chunks - v % chunks), value=float("-inf"))
    best, at = scores.view(rows, chunks, -1).max(-1)  # per piece
    piece = best.argmax(-1, keepdim=True)
    return (piece * scores.shape[1] // chunks + at.gather(1, piece)).squeeze(1)


class RowCache:
    """Keys and values [rows, kv_heads, max_len, head_dim] per layer, written at one column.

    Duck-types the one method transformers' attention calls (`update`). `select` restricts a
    forward to some rows (prefill of new rows); decoding always runs every row."""

    def __init__(self, n_layers: int, rows: int, kv_heads: int, head_dim: int, max_len: int, dtype, device):
        shape = (rows, kv_heads, max_len + SLACK, head_dim)  # slack: a graph's warm-up steps write past the end
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.col = torch.zeros((), dtype=torch.long, device=device)  # the next column to write
        self.select: torch.Tensor | None = None
        self.upto: int | None = None  # eager forwards read only the columns written so far

    def update(self, key, value, layer_idx, *args, **kwargs):
        cols = self.col + torch.arange(key.shape[2], device=key.device)
        k, v = self.k[layer_idx], self.v[layer_idx]
        if self.select is None:
            k.index_copy_(2, cols, key)
            v.index_copy_(2, cols, value)
        else:
            k[self.select[:, None], :, cols[None, :]] = key.transpose(1, 2)
            v[self.select[:, None], :, cols[None, :]] = value.transpose(1, 2)
            return k[self.select, :, :self.upto], v[self.select, :, :self.upto]  # a copy: only what is read
        return (k, v) if self.upto is None else (k[:, :, :self.upto], v[:, :, :self.upto])

    def copy_columns(self, src: int, dst: int, upto: int) -> None:
        for k, v in zip(self.k, self.v):
            k[dst, :, :upto] = k[src, :, :upto]
            v[dst, :, :upto] = v[src, :, :upto]

    def gather_columns(self, index: torch.Tensor) -> None:
        """Per row, move the columns `index[row]` to the front (compaction)."""
        idx = index[:, None, :, None]
        for k, v in zip(self.k, self.v):
            n = index.shape[1]
            k[:, :, :n] = k.gather(2, idx.expand(-1, k.shape[1], -1, k.shape[3]))
            v[:, :, :n] = v.gather(2, idx.expand(-1, v.shape[1], -1, v.shape[3]))


@dataclass
class _Row:
    tokens: list[int] = field(default_factory=list)  # real tokens in the cache, in order
    tag: int = 0
    used: float = 0.0  # last use, for eviction


class Engine:
    """Static-cache batched generation over `rows` conversations (see the module docstring).

    `compile`: "graph" captures the decode step in a CUDA graph (CUDA only), "inductor" first
    fuses it with torch.compile (then, on CUDA, captures that), "eager" runs it as it is (the CPU
    default)."""

    def __init__(self, model, tokenizer, rows: int = 8, max_len: int = 4096, compile: str = "auto",
                 prefill_tokens: int = 8192, check_every: int = 8,
                 before_forward: Callable[[torch.Tensor], None] | None = None):
        self.model, self.tok = model, tokenizer
        self.hf = _hf_model(model)
        cfg = self.hf.config.get_text_config() if hasattr(self.hf.config, "get_text_config") else self.hf.config
        self.device = next(model.parameters()).device
        self.dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
        if compile == "auto":
            compile = "graph" if self.device.type == "cuda" else "eager"
        if compile not in ("graph", "inductor", "eager"):
            raise ValueError(f"compile={compile!r}: use graph, inductor or eager")
        if compile == "graph" and self.device.type != "cuda":
            compile = "eager"  # CUDA graphs need CUDA
        self.mode, self.rows, self.max_len = compile, rows, max_len
        self.prefill_tokens, self.check_every = prefill_tokens, check_every
        self.before_forward = before_forward
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        _use_row_attention(self.hf)
        self.fuse = compile != "eager"  # fewer, larger GEMMs (models/fuse.py): launches bound a small-batch step
        self.limit = getattr(cfg, "max_position_embeddings", None) or 1 << 20
        self._shape = (cfg.num_hidden_layers, rows, kv_heads, head_dim)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.stops = torch.tensor(stop_ids(tokenizer), device=self.device)
        self.stop_set = set(stop_ids(tokenizer))
        dev = self.device
        self.n_real = torch.zeros(rows, dtype=torch.long, device=dev)  # a row's tokens so far = its next position
        # decode state, mutated in place by the step (static addresses for graph replay)
        self.tok = torch.zeros(rows, dtype=torch.long, device=dev)
        self.live = torch.zeros(rows, dtype=torch.bool, device=dev)
        self.left = torch.zeros(rows, dtype=torch.long, device=dev)  # tokens a row may still sample
        self.temp = torch.zeros(rows, dtype=torch.float32, device=dev)
        self.tags = torch.zeros(rows, dtype=torch.long, device=dev)
        self.out = torch.zeros(rows, 1, dtype=torch.long, device=dev)  # the token sampled this step
        self.vocab_size = self.hf.get_output_embeddings().weight.shape[0]
        self.allow = torch.full((rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32, device=dev)  # grammar bits
        self._bits = torch.arange(32, dtype=torch.int32, device=dev)
        self._allocate(min(max_len, self.limit))
        self.lock = threading.Lock()
        self.stats = {"prefill_tokens": 0, "reused_tokens": 0, "decode_steps": 0, "compactions": 0}

    # -------------------------------------------------------------- bookkeeping
    def _allocate(self, max_len: int) -> None:
        """The cache and column mask for `max_len` tokens per row; every row starts empty. If the
        memory is not there, the engine keeps the cache it had (and the error goes to the caller)."""
        cache = RowCache(*self._shape, max_len, self.dtype, self.device)
        valid = torch.zeros(self.rows, max_len + SLACK, dtype=torch.bool, device=self.device)  # a row's token columns
        self.cache, self.valid, self.max_len = cache, valid, max_len
        self._graph, self._compiled = {}, {}  # per step kind: free, or masked by a grammar
        self.reset()

    def reset(self) -> None:
        """Forget every row (weights changed: cached keys are stale; replaced tensors are stacked again)."""
        if self.fuse:
            fuse_projections(self.hf)
        self.state = [_Row() for _ in range(self.rows)]
        self.valid.zero_()
        self.n_real.zero_()
        self.cache.col.zero_()

    @property
    def col(self) -> int:
        return int(self.cache.col)

    def _assign(self, reqs: list[Request]) -> tuple[list[int], dict[int, int]]:
        """(row per request, {follower: tokens it shares with its leader}). A request continues the row whose tokens it extends;
        a new one takes the least recently used other row, started from the longest prefix
        another row holds. A new request that shares more with an earlier new request of this
        call (a GRPO group's identical prompts, a domain's system prompt) is a follower: its row
        is started from that request's row once that one has been fed."""
        taken, rows = set(), []
        for r in reqs:
            j = next((j for j, s in enumerate(self.state) if j not in taken and s.tokens and s.tag == r.tag
                      and len(s.tokens) < len(r.ids) and r.ids[:len(s.tokens)] == s.tokens), None)
            rows.append(j)
            if j is not None:
                taken.add(j)
        free = sorted((j for j in range(self.rows) if j not in taken), key=lambda j: self.state[j].used)
        leaders, followers = [], {}  # follower -> tokens it will copy from its leader
        for i, j in enumerate(rows):
            if j is not None:
                continue
            rows[i] = free.pop(0)
            own = max((common_prefix(reqs[l].ids, reqs[i].ids) for l in leaders if reqs[l].tag == reqs[i].tag),
                      default=0)
            own = min(own, len(reqs[i].ids) - 1)
            if own >= MIN_SHARED_PREFIX and own > self._donor(reqs[i])[1]:
                self._clear_row(rows[i], reqs[i].tag)
                followers[i] = own
            elif self._start_row(rows[i], reqs[i]) < MIN_SHARED_PREFIX:
                leaders.append(i)
        return rows, followers

    def _donor(self, req: Request) -> tuple[int | None, int]:
        """(row, tokens): the row holding the longest prefix of `req` (one token is left to feed)."""
        best, n = None, 0
        for j, s in enumerate(self.state):
            if s.tokens and s.tag == req.tag:
                m = min(common_prefix(s.tokens, req.ids), len(req.ids) - 1)
                if m > n:
                    best, n = j, m
        return best, n

    def _clear_row(self, row: int, tag: int) -> None:
        self.valid[row] = False
        self.n_real[row] = 0
        self.state[row] = _Row(tag=tag)

    def _start_row(self, row: int, req: Request) -> int:
        """Start `row` for `req` from the longest prefix of `req` any row holds (the row's own
        content included: a conversation whose last turn re-renders differently keeps the rest)."""
        best, n = self._donor(req)
        if best is None or n < MIN_SHARED_PREFIX:
            self._clear_row(row, req.tag)
            return 0
        cols = self.valid[best].nonzero().flatten()
        upto = int(cols[n - 1]) + 1
        if best != row:
            self._clear_row(row, req.tag)
            self.cache.copy_columns(best, row, upto)
            self.valid[row, :upto] = self.valid[best, :upto]
        self.valid[row, upto:] = False
        self.n_real[row] = n
        self.state[row] = _Row(tokens=list(req.ids[:n]), tag=req.tag)
        self.stats["reused_tokens"] += n
        return n

    def _compact(self) -> None:
        """Move every row's tokens to the front columns (exact: positions are stored in the keys)."""
        counts = self.valid.sum(1)
        width = int(counts.max()) if self.rows else 0
        order = torch.sort((~self.valid).to(torch.int8), dim=1, stable=True).indices[:, :width]  # valid columns first
        self.cache.gather_columns(order)
        self.valid.copy_(torch.arange(self.valid.shape[1], device=self.device)[None, :] < counts[:, None])  # in place:
        self.cache.col.fill_(width)  # a captured step keeps reading the same tensors
        self.stats["compactions"] += 1

    # -------------------------------------------------------------- forwards
    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, tags: torch.Tensor, select=None,
                 upto: int | None = None):
        """Logits after each row's last token. `upto` (eager only): attend to the first `upto` columns."""
        mask = mask if upto is None else mask[..., :upto]  # 4D: transformers passes it through as it is
        self.cache.select, self.cache.upto = select, upto
        if self.before_forward:
            self.before_forward(tags)
        try:
            return self.model(input_ids=ids, position_ids=pos, attention_mask=mask, cache=self.cache,
                              use_cache=True, logits_to_keep=1, rows_engine=True).logits[:, -1].float()
        finally:
            self.cache.select = self.cache.upto = None
            if self.before_forward:
                self.before_forward(None)

    def _prefill(self, rows: list[int], chunks: list[list[int]]) -> torch.Tensor:
        """Feed each row its new tokens (left-padded to one width), in slices; the last logits per row."""
        width = max(len(c) for c in chunks)
        sel = torch.tensor(rows, device=self.device)
        real = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in chunks], device=self.device).bool()
        ids = torch.tensor([[self.pad] * (width - len(c)) + c for c in chunks], device=self.device)
        pos = self.n_real[sel, None] + real.long().cumsum(1) - 1
        step = max(16, self.prefill_tokens // len(rows))
        cols = torch.arange(self.valid.shape[1], device=self.device)
        logits = None
        for a in range(0, width, step):
            b = min(width, a + step)
            c0 = self.col
            self.valid[sel, c0:c0 + b - a] = real[:, a:b]
            q = c0 + torch.arange(b - a, device=self.device)
            # a row's real tokens before each query, and the query's own column (a padding query
            # attending to nothing would give NaN keys, and a masked NaN still poisons attention)
            mask = self.valid[sel][:, None, :] & (cols[None, None, :] <= q[None, :, None]) | (cols[None, None, :] == q[None, :, None])
            whole = rows == list(range(self.rows))
            logits = self._forward(ids[:, a:b], pos[:, a:b].clamp(min=0), mask[:, None], self.tags[sel],
                                   select=None if whole else sel, upto=c0 + b - a)
            self.cache.col += b - a
        self.n_real[sel] += real.sum(1)
        self.stats["prefill_tokens"] += int(real.sum())
        return logits

    def _sample(self, logits: torch.Tensor, temp: torch.Tensor, allow: torch.Tensor | None = None) -> torch.Tensor:
        """Plain softmax sampling at each row's temperature (Gumbel-max), argmax where it is 0; with
        `allow` (bit j of word w set: token 32w+j allowed), among the allowed tokens only."""
        if allow is not None:
            ok = ((allow[:, :, None] >> self._bits) & 1).flatten(1)[:, :logits.shape[-1]].bool()
            logits = logits.masked_fill(~ok, float("-inf"))
        u = torch.rand_like(logits).clamp_(min=1e-20)
        gumbel = -torch.log(-torch.log(u))
        t = temp[:, None]
        scores = torch.where(t > 0, logits / t.clamp(min=1e-6) + gumbel, logits)
        return _argmax(scores)

    def _step(self, masked: bool = False) -> None:
        """Feed each live row its last token, sample the next one; all on the device."""
        col = self.cache.col.view(1)
        self.valid.index_fill_(1, col, True)  # every query sees its own column (no NaN in idle rows)
        upto = int(col) + 1 if self.mode == "eager" else None  # a captured step reads every column
        logits = self._forward(self.tok.view(-1, 1), self.n_real.view(-1, 1), self.valid[:, None, None, :], self.tags,
                               upto=upto)
        self.valid.index_copy_(1, col, self.live.view(-1, 1))  # kept only where a live row's token sits
        self.cache.col.add_(1)
        self.n_real.add_(self.live.long())
        nxt = torch.where(self.live, self._sample(logits, self.temp, self.allow if masked else None),
                          torch.full_like(self.tok, self.pad))
        self.tok.copy_(nxt)
        self.out.copy_(nxt.view(-1, 1))
        self.left.sub_(self.live.long())
        self.live.logical_and_(~torch.isin(nxt, self.stops) & (self.left > 0))

    def _run_step(self, masked: bool = False) -> None:
        if masked not in self._compiled:
            step = lambda: self._step(masked)  # noqa: E731
            if self.mode == "inductor":  # fused kernels; on CUDA then replayed as one graph like "graph"
                from torch import _dynamo

                _dynamo.config.cache_size_limit = max(64, _dynamo.config.cache_size_limit)
                step = torch.compile(step, fullgraph=False)
            self._compiled[masked] = step
        run = self._compiled[masked]
        if self.device.type != "cuda" or self.mode == "eager":
            return run()
        if masked not in self._graph:  # capture once per cache layout, after warm-up runs on a side stream
            saved = [t.clone() for t in self._graph_state()]
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):  # (the first runs compile, under inductor)
                    run()
            torch.cuda.current_stream().wait_stream(s)
            for t, v in zip(self._graph_state(), saved):  # undo the warm-up steps
                t.copy_(v)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):  # records, runs nothing; kept only once it is whole
                run()
            self._graph[masked] = graph
        self._graph[masked].replay()

    def _graph_state(self) -> list[torch.Tensor]:
        """Everything the step mutates, except the cache's keys (rewritten at the same column)."""
        return [self.cache.col, self.valid, self.n_real, self.tok, self.live, self.left, self.out]

    # -------------------------------------------------------------- the public call
    @torch.no_grad()
    def generate(self, reqs: list[Request]) -> list[list[int]]:
        """One sampled turn per request, each cut after (and including) its first end-of-turn token."""
        for r in reqs:
            if len(r.ids) + r.max_new > self.limit:
                raise ValueError(f"a request needs {len(r.ids) + r.max_new} tokens; the model takes {self.limit}")
            if not r.ids or r.max_new < 1:
                raise ValueError("a request needs at least one prompt token and max_new >= 1")
        with self.lock:
            need = max(len(r.ids) + r.max_new for r in reqs)
            if need > self.max_len:  # a longer conversation than planned for: a larger cache, rows forgotten
                self._allocate(min(self.limit, 1 << (need - 1).bit_length()))
            try:
                return self._generate(reqs)
            except BaseException:  # half-done bookkeeping must not leak into a later continuation
                self.reset()
                raise

    def _generate(self, reqs: list[Request]) -> list[list[int]]:
        if len(reqs) > self.rows:
            return self._generate(reqs[:self.rows]) + self._generate(reqs[self.rows:])
        for attempt in range(3):  # as it is; after compacting the columns; from an empty cache
            rows, followers = self._assign(reqs)
            first = [i for i in range(len(reqs)) if i not in followers]
            need = max(len(reqs[i].ids) - len(self.state[rows[i]].tokens) for i in first) \
                + max((len(reqs[i].ids) - followers[i] for i in followers), default=0) + max(r.max_new for r in reqs)
            if self.col + need <= self.max_len:
                break
            if attempt == 0:
                self._compact()
            elif attempt == 1:
                self.reset()
        else:
            if len(reqs) == 1:
                raise RuntimeError("engine: a single request does not fit an empty cache")
            half = len(reqs) // 2
            return self._generate(reqs[:half]) + self._generate(reqs[half:])
        now = time.monotonic()
        for j in rows:
            self.state[j].used = now
        sel = torch.tensor(rows, device=self.device)
        self.tags[sel] = torch.tensor([r.tag for r in reqs], device=self.device)
        last: dict[int, torch.Tensor] = {}  # request -> logits after its last prompt token
        for phase in (first, list(followers)):
            if phase and phase[0] in followers:
                for i in phase:
                    self._start_row(rows[i], reqs[i])
            if phase:
                out = self._prefill([rows[i] for i in phase],
                                    [reqs[i].ids[len(self.state[rows[i]].tokens):] for i in phase])
                last.update(zip(phase, out))
                for i in phase:
                    self.state[rows[i]].tokens = list(reqs[i].ids)
        logits = torch.stack([last[i] for i in range(len(reqs))])
        # decode
        self.temp.zero_()
        self.temp[sel] = torch.tensor([float(r.temperature) for r in reqs], device=self.device)
        grammars = {i: r.grammar for i, r in enumerate(reqs) if r.grammar is not None}
        host = torch.full(self.allow.shape, -1, dtype=torch.int32) if grammars else None
        for i, m in grammars.items():
            m.fill_next_token_bitmask(host, rows[i])
        if grammars:
            self.allow.copy_(host)
        tok = self._sample(logits, self.temp[sel], self.allow[sel] if grammars else None)
        self.live.zero_()
        self.left.zero_()
        self.left[sel] = torch.tensor([r.max_new - 1 for r in reqs], device=self.device)
        self.tok[sel] = tok
        self.live[sel] = ~torch.isin(tok, self.stops) & (self.left[sel] > 0)
        produced, cut = [tok], {}  # cut: request -> reply length, where its matcher refused a token
        for i in range(max(r.max_new for r in reqs) - 1):
            if grammars:  # once every constrained row is done, the rest decode free (no host round trip)
                self._advance(grammars, reqs, rows, produced, host, cut)
            if (grammars or i % self.check_every == 0) and not bool(self.live.any()):
                break
            self._run_step(bool(grammars))
            produced.append(self.out[sel, 0].clone())
            self.stats["decode_steps"] += 1
        table = torch.stack(produced, 1).tolist()
        stops = self.stop_set
        results = []
        for k, (r, j, row) in enumerate(zip(reqs, rows, table)):
            toks = row[:r.max_new]
            if k in cut:  # the refused token was never fed; every one before it was
                toks = toks[:cut[k]]
                self.state[j].tokens = list(r.ids) + toks
            else:
                toks = toks[:next((n + 1 for n, t in enumerate(toks) if t in stops), len(toks))]
                self.state[j].tokens = list(r.ids) + toks[:-1]  # the last sampled token was never fed
            results.append(toks)
        return results

    def _advance(self, grammars: dict, reqs: list[Request], rows: list[int], produced: list[torch.Tensor],
                 host: torch.Tensor, cut: dict) -> None:
        """Feed each constrained request's newest token to its matcher and refill its row of the mask.
        A row that stopped (a stop token, its `max_new` spent) leaves `grammars`. A token the matcher
        refuses (the mask and the matcher disagree: an xgrammar bug) ends the row before it is fed."""
        n, toks = len(produced), produced[-1].tolist()
        for i, m in list(grammars.items()):
            if toks[i] in self.stop_set or n >= reqs[i].max_new:
                del grammars[i]
            elif not m.accept_token(toks[i]):
                del grammars[i]
                cut[i] = n - 1
                self.live[rows[i]] = False
            else:
                m.fill_next_token_bitmask(host, rows[i])
        if grammars:
            self.allow.copy_(host)


class Batcher:
    """Many threads' single requests -> one `Engine.generate` over all that arrive together.

    A request waits up to `window` seconds for others (or until `rows` are waiting), so episodes
    running in threads (evaluation, the HTTP server) advance one batched turn at a time."""

    def __init__(self, engine: Engine, window: float = 0.05):
        self.engine, self.window = engine, window
        self._cv = threading.Condition()
        self._queue: list[tuple[Request, dict]] = []
        self._worker: threading.Thread | None = None

    def submit(self, req: Request) -> list[int]:
        slot: dict = {}
        with self._cv:
            self._queue.append((req, slot))
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._loop, daemon=True)
                self._worker.start()
            self._cv.notify_all()
            while "out" not in slot and "error" not in slot:
                self._cv.wait()
        if "error" in slot:
            raise slot["error"]
        return slot["out"]

    def _loop(self) -> None:
        while True:
            with self._cv:
                if not self._queue:
                    if not self._cv.wait(timeout=5.0) and not self._queue:
                        self._worker = None
                        return
                    continue
                deadline = time.monotonic() + self.window
                while len(self._queue) < self.engine.rows and (left := deadline - time.monotonic()) > 0:
                    self._cv.wait(timeout=left)
                batch, self._queue = self._queue[:self.engine.rows], self._queue[self.engine.rows:]
            try:
                outs = self.engine.generate([r for r, _ in batch])
                for (_, slot), out in zip(batch, outs):
                    slot["out"] = out
            except Exception as err:  # every waiting caller gets the error, none hangs
                for _, slot in batch:
                    slot["error"] = err
            with self._cv:
                self._cv.notify_all()
