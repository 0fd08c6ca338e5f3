"""GPT-2 in the shape of nanoGPT, loadable from transformers, with a batched KV-cache generator."""
import math
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

PRETRAINED = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),
}
# transformers' GPT-2 uses Conv1D for these, whose weights are the transpose of nn.Linear's.
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50257
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, x, kv_cache=None, input_pos=None, mask=None, lengths=None):
        """Causal attention over x; with kv_cache, x's keys/values are first written into cache slots
        input_pos and the queries attend to the cache slots that `mask` (B, 1, T, cache_len) allows.
        With `lengths`, x (1, T, C) is prompts packed back to back: each attends causally within itself
        and its keys/values go into its own cache row (KVCache.fill)."""
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if lengths is not None:
            kv_cache.fill(k, v, lengths)
            y = torch.cat([F.scaled_dot_product_attention(*qkv, is_causal=True)
                           for qkv in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2))], dim=2)
        elif kv_cache is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                               is_causal=True)
        else:
            k, v = kv_cache.update(input_pos, k, v, mask.size(-1))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's "gelu_new"
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, kv_cache=None, input_pos=None, mask=None, lengths=None):
        x = x + self.attn(self.ln_1(x), kv_cache, input_pos, mask, lengths)
        return x + self.mlp(self.ln_2(x))


class KVCache:
    """One layer's keys and values, (rows, heads, max_len, head_dim), allocated by the prefill (fill, in the
    dtype the layer computes in, e.g. fp16 under autocast) and then written in place by each decode step."""

    def __init__(self, max_len):
        self.max_len = max_len
        self.k = self.v = None

    def update(self, input_pos, k, v, length):
        """Write k, v at slots input_pos; return the first `length` slots (the rest are not yet written)."""
        self.k.index_copy_(2, input_pos, k)
        self.v.index_copy_(2, input_pos, v)
        return self.k[:, :, :length], self.v[:, :, :length]

    def fill(self, k, v, lengths):
        """Write prompts packed along k, v (1, H, sum(lengths), D) into one row each, right-aligned at slot
        max(lengths) - 1: the left-padded layout that decoding continues. Starts the cache afresh."""
        _, H, _, D = k.shape
        self.k = k.new_zeros(len(lengths), H, self.max_len, D)
        self.v = k.new_zeros(len(lengths), H, self.max_len, D)
        end = max(lengths)
        for row, (k_row, v_row) in enumerate(zip(k.split(lengths, 2), v.split(lengths, 2))):
            self.k[row, :, end - k_row.size(2):end] = k_row[0]
            self.v[row, :, end - v_row.size(2):end] = v_row[0]

    def select_rows(self, rows):
        """Keep (or reorder, for beam search) the rows given by index tensor `rows`."""
        self.k = self.k.index_select(0, rows)
        self.v = self.v.index_select(0, rows)


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as in GPT-2
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        self._compiled_decode = None
        self.gradient_checkpointing = False  # set by the trainer (config key gradient_checkpointing)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding=True):
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def training_flops(self, tokens, targets, attended):
        """Model FLOPs of a training step (forward + backward = 3x forward, 2 per multiply-add) over `tokens`
        tokens of which `targets` are supervised: the blocks at every token, lm_head at the targets only (all
        that forward computes), and attention, with `attended` = the sum of squared sequence lengths."""
        head = self.lm_head.weight.numel()
        return (6 * (self.num_params() - head) * tokens + 6 * head * targets
                + 12 * self.config.n_layer * self.config.n_embd * attended)

    def forward(self, idx, targets=None):
        """idx (B, T) -> (logits, loss). Without targets: logits for every position (B, T, vocab), loss None.
        With targets (B, T; -1 = ignore): the mean cross-entropy over non-ignored targets, and logits None,
        because only the supervised positions go through lm_head (a summary is ~15% of a training row)."""
        B, T = idx.size()
        if T > self.config.block_size:
            raise ValueError(f"sequence of length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                # keep only the block's input; its activations are recomputed (same dropout masks) in backward
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x), None
        supervised = targets != -1
        logits = self.lm_head(x[supervised])
        loss = F.cross_entropy(logits.float(), targets[supervised], reduction="sum") / supervised.sum().clamp(min=1)
        return None, loss

    def forward_cached(self, idx, positions, input_pos, kv_caches, mask):
        """Run idx (B, T) at per-row positions (B, T), writing its keys/values into the caches at cache slots
        input_pos (T,); queries attend to the first L cache slots as the boolean mask (B, 1, T, L) allows.
        Returns the logits of the last position only (B, vocab)."""
        x = self.transformer.wte(idx) + self.transformer.wpe(positions)
        mask = torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill_(~mask, float("-inf"))
        for block, cache in zip(self.transformer.h, kv_caches):
            x = block(x, cache, input_pos, mask)
        return self.next_token_logits(x[:, -1])

    def prefill(self, prompts, kv_caches):
        """Run the prompts packed back to back in one sequence, so no compute goes to padding, filling each
        prompt's cache row (left-padded layout). Returns the logits of each prompt's last position (B, vocab)."""
        device = self.lm_head.weight.device
        lengths = [len(p) for p in prompts]
        idx = torch.tensor([[t for p in prompts for t in p]], device=device)
        positions = torch.cat([torch.arange(n, device=device) for n in lengths])
        x = self.transformer.wte(idx) + self.transformer.wpe(positions)
        for block, cache in zip(self.transformer.h, kv_caches):
            x = block(x, cache, lengths=lengths)
        last = torch.tensor(lengths, device=device).cumsum(0) - 1
        return self.next_token_logits(x[0, last])

    def next_token_logits(self, x):
        """lm_head over one hidden state per row (B, C) -> (B, vocab), as W @ x^T: at these shapes the CPU BLAS
        runs that 1.6-3x faster than x @ W^T, and this matmul is most of a decode step."""
        return (self.lm_head.weight @ self.transformer.ln_f(x).t()).t()

    def set_dropout(self, p):
        """Change the dropout probability everywhere (a resumed run may train with another one)."""
        self.config.dropout = p
        self.transformer.drop.p = p
        for block in self.transformer.h:  # these only: LoRA adapters keep their own dropout (lora_dropout)
            block.attn.resid_dropout.p = block.mlp.dropout.p = block.attn.dropout = p

    def crop_block_size(self, block_size):
        """Shrink the context window (e.g. 1024 -> 512 to save memory); keeps the first position embeddings."""
        assert block_size <= self.config.block_size
        self.config.block_size = block_size
        self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size])

    @classmethod
    def from_pretrained(cls, name_or_path, dropout=0.0):
        """GPT-2 weights from transformers: a hub name (gpt2 .. gpt2-xl) or a local save_pretrained directory."""
        from transformers import GPT2LMHeadModel

        if name_or_path not in PRETRAINED and not os.path.isdir(name_or_path):
            raise FileNotFoundError(
                f"{name_or_path!r} is neither one of {', '.join(PRETRAINED)} nor a local directory")
        try:
            hf = GPT2LMHeadModel.from_pretrained(name_or_path, torch_dtype=torch.float32)
        except OSError as e:
            raise FileNotFoundError(f"could not load GPT-2 weights from {name_or_path!r}: {e}") from None
        hf_config = hf.config
        config = GPTConfig(block_size=hf_config.n_positions, vocab_size=hf_config.vocab_size,
                           n_layer=hf_config.n_layer, n_head=hf_config.n_head, n_embd=hf_config.n_embd,
                           dropout=dropout, bias=True)
        model = cls(config)
        sd_hf = hf.state_dict()
        with torch.no_grad():
            for name, p in model.state_dict().items():
                p.copy_(sd_hf[name].t() if name.endswith(CONV1D_WEIGHTS) else sd_hf[name])
        return model

    # ---- generation -------------------------------------------------------------------------------------

    def compile_decode(self):
        """Use a torch.compile'd single-token decode step in generate() from now on. Compiling happens at the
        first call (and at a recompile); if it fails: one warning line, and eager decoding from then on."""
        compiled = torch.compile(self.forward_cached, dynamic=True)

        def decode(*args):
            if self._compiled_decode is decode:
                try:
                    return compiled(*args)
                except Exception as e:  # a failed step wrote nothing the eager retry does not overwrite
                    warn_compile_failed(e, "decoding eagerly")
                    self._compiled_decode = None
            return self.forward_cached(*args)

        self._compiled_decode = decode

    @torch.inference_mode()
    def generate(self, prompts, max_new_tokens, eos_token_id=50256, temperature=0.0, top_k=None, top_p=None,
                 num_beams=1, length_penalty=1.0, repetition_penalty=1.0, no_repeat_ngram_size=0, seed=None):
        """Continue each prompt (a list of token-id lists, any lengths) by up to max_new_tokens tokens.
        Returns, in the prompts' order, the new token ids of each row, cut before its first EOS.
        temperature=0 is greedy; num_beams>1 is beam search with transformers' semantics (early_stopping=False).
        Prompts longer than block_size - max_new_tokens keep their last tokens."""
        if not 0 < max_new_tokens < self.config.block_size:
            raise ValueError(f"max_new_tokens must be in [1, block_size={self.config.block_size}), got {max_new_tokens}")
        if num_beams > 1 and temperature > 0:
            raise ValueError("beam search is deterministic: use temperature=0.0 with num_beams > 1")
        if not prompts:
            return []
        max_prompt = self.config.block_size - max_new_tokens
        prompts = [list(p)[-max_prompt:] for p in prompts]
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        device = self.lm_head.weight.device
        state = DecodeState(prompts, max_new_tokens, device)
        kv_caches = [KVCache(state.max_len) for _ in self.transformer.h]
        logits = self.prefill(prompts, kv_caches)
        processors = LogitsProcessors(repetition_penalty, no_repeat_ngram_size, temperature, top_k, top_p)
        decode = self._compiled_decode or self.forward_cached
        if num_beams > 1:
            new_tokens = beam_search(decode, logits, state, kv_caches, processors, num_beams, length_penalty,
                                     eos_token_id)
        else:
            generator = None
            if temperature > 0:
                generator = torch.Generator(device=device)
                if seed is None:
                    generator.seed()
                else:
                    generator.manual_seed(seed)
            new_tokens = sample(decode, logits, state, kv_caches, processors, eos_token_id, generator)
        return [cut_at_eos(row, eos_token_id) for row in new_tokens.tolist()]


def warn_compile_failed(error, fallback):
    """One stderr line for a torch.compile failure: the compiler's own error and what runs instead."""
    error = getattr(error, "inner_exception", None) or error  # dynamo wraps the backend's exception
    reason = str(error).strip().splitlines()
    print(f"warning: torch.compile failed ({type(error).__name__}: {reason[0] if reason else ''}); {fallback}",
          file=sys.stderr)


def cut_at_eos(tokens, eos_token_id):
    return tokens[:tokens.index(eos_token_id)] if eos_token_id in tokens else tokens


class DecodeState:
    """The left-padded batch being decoded: token history, which cache slots hold real tokens, positions."""

    def __init__(self, prompts, max_new_tokens, device):
        P = max(len(p) for p in prompts)
        self.prompt_len, self.max_len = P, P + max_new_tokens
        # Left padding repeats each row's first token, so padding never adds a token the row does not have
        # (repetition penalty scatters over the history); pad slots are masked out of attention.
        history = [[p[0]] * (P - len(p)) + p + [0] * max_new_tokens for p in prompts]
        self.history = torch.tensor(history, dtype=torch.long, device=device)
        self.pad = torch.tensor([P - len(p) for p in prompts], device=device)
        slots = torch.arange(self.max_len, device=device)
        self.slot_filled = (slots[None, :] >= self.pad[:, None]) & (slots[None, :] < P)
        # The position and cache slot of each row's last prompt token; append() moves them on.
        self.positions = torch.tensor([[len(p) - 1] for p in prompts], device=device)
        self.input_pos = slots[P - 1:P]
        self.tokens = None
        self.step = 0

    def append(self, next_tokens):
        """Record each row's next token and point the state at the slot it goes into."""
        slot = self.prompt_len + self.step
        self.history[:, slot] = next_tokens
        self.slot_filled[:, slot] = True
        self.tokens = next_tokens[:, None]
        self.positions = self.positions + 1
        self.input_pos = self.input_pos + 1
        self.step += 1

    def decode_mask(self):
        return self.slot_filled[:, None, None, :self.prompt_len + self.step]

    def seen_tokens(self):
        return self.history[:, :self.prompt_len + self.step]

    def select_rows(self, rows):
        self.history, self.pad = self.history[rows], self.pad[rows]
        self.slot_filled, self.positions = self.slot_filled[rows], self.positions[rows]


class LogitsProcessors:
    """transformers' logits processors and warpers, in its order: repetition penalty, no-repeat n-grams,
    then (sampling only) temperature, top-k, top-p."""

    def __init__(self, repetition_penalty, no_repeat_ngram_size, temperature, top_k, top_p):
        self.repetition_penalty, self.no_repeat_ngram_size = repetition_penalty, no_repeat_ngram_size
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p

    def penalize(self, scores, state):
        if self.repetition_penalty != 1.0:
            seen = state.seen_tokens()
            s = scores.gather(1, seen)
            scores.scatter_(1, seen, torch.where(s < 0, s * self.repetition_penalty, s / self.repetition_penalty))
        if self.no_repeat_ngram_size > 0:
            n = self.no_repeat_ngram_size
            for row, (seq, pad) in enumerate(zip(state.seen_tokens().tolist(), state.pad.tolist())):
                seq = seq[pad:]
                if len(seq) + 1 < n:
                    continue
                prefix = tuple(seq[len(seq) - n + 1:])
                banned = [seq[i + n - 1] for i in range(len(seq) - n + 1) if tuple(seq[i:i + n - 1]) == prefix]
                scores[row, banned] = -float("inf")
        return scores

    def warp(self, logits):
        logits = logits / self.temperature
        if self.top_k:
            kth = torch.topk(logits, min(self.top_k, logits.size(-1))).values[:, -1:]
            logits = logits.masked_fill(logits < kth, -float("inf"))
        if self.top_p is not None and self.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=False)
            cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            remove = cumulative <= 1 - self.top_p
            remove[:, -1] = False
            logits = logits.masked_fill(remove.scatter(1, order, remove), -float("inf"))
        return logits


def sample(decode, logits, state, kv_caches, processors, eos_token_id, generator):
    """Greedy (generator None) or sampled decoding. Rows that emit EOS are dropped from the batch, so the
    remaining rows get cheaper; the loop ends when every row has finished or max_new_tokens is reached."""
    B = logits.size(0)
    max_new = state.max_len - state.prompt_len
    out = torch.full((B, max_new), eos_token_id, dtype=torch.long, device=logits.device)
    rows = torch.arange(B, device=logits.device)
    for step in range(max_new):
        scores = processors.penalize(logits.float(), state)
        if generator is None:
            next_tokens = scores.argmax(dim=-1)
        else:
            probs = processors.warp(scores).softmax(dim=-1)
            next_tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        out[rows, step] = next_tokens
        if step == max_new - 1:
            break
        alive = next_tokens != eos_token_id
        if not alive.all():
            if not alive.any():
                break
            keep = alive.nonzero().squeeze(1)
            rows, next_tokens = rows[keep], next_tokens[keep]
            state.select_rows(keep)
            for cache in kv_caches:
                cache.select_rows(keep)
        state.append(next_tokens)
        logits = decode(state.tokens, state.positions, state.input_pos, kv_caches, state.decode_mask())
    return out


def beam_search(decode, logits, state, kv_caches, processors, num_beams, length_penalty, eos_token_id):
    """transformers' beam search (early_stopping=False): each step keeps the 2*num_beams best continuations;
    those ending in EOS (or at the length limit) among the top num_beams become finished hypotheses scored
    sum_logprob / new_len**length_penalty; a batch item stops once no running beam can beat its worst
    finished one. Returns the best hypothesis of each item."""
    B, V, K = logits.size(0), logits.size(-1), num_beams
    max_new = state.max_len - state.prompt_len
    device = logits.device
    expand = torch.arange(B, device=device).repeat_interleave(K)
    state.select_rows(expand)
    for cache in kv_caches:
        cache.select_rows(expand)
    logits = logits[expand]
    running_scores = torch.full((B, K), -1e9, device=device)
    running_scores[:, 0] = 0.0
    running_seqs = torch.full((B, K, max_new), eos_token_id, dtype=torch.long, device=device)
    finished_seqs = running_seqs.clone()
    finished_scores = torch.full((B, K), -1e9, device=device)
    is_finished = torch.zeros(B, K, dtype=torch.bool, device=device)
    improvable = torch.ones(B, 1, dtype=torch.bool, device=device)
    top_k_mask = torch.arange(2 * K, device=device) < K
    batch_offset = torch.arange(B, device=device)[:, None] * K
    for step in range(max_new):
        log_probs = processors.penalize(F.log_softmax(logits.float(), dim=-1), state)
        log_probs = (log_probs.view(B, K, V) + running_scores[:, :, None]).view(B, K * V)
        topk_scores, topk_ids = torch.topk(log_probs, 2 * K)
        source_beam, token = topk_ids // V, topk_ids % V
        topk_seqs = running_seqs.gather(1, source_beam[:, :, None].expand(-1, -1, max_new)).clone()
        topk_seqs[:, :, step] = token
        hits_stop = (token == eos_token_id) | (step + 1 == max_new)

        still_running = topk_scores - 1e9 * hits_stop.float()
        keep = torch.topk(still_running, K).indices
        running_seqs = topk_seqs.gather(1, keep[:, :, None].expand(-1, -1, max_new))
        running_scores = still_running.gather(1, keep)
        parent = source_beam.gather(1, keep)

        just_finished = hits_stop & top_k_mask
        candidate = topk_scores / ((step + 1) ** length_penalty)
        candidate = candidate - 1e9 * (~improvable).float() - 1e9 * (~just_finished).float()
        merged_scores = torch.cat((finished_scores, candidate), dim=1)
        best = torch.topk(merged_scores, K).indices
        finished_scores = merged_scores.gather(1, best)
        finished_seqs = torch.cat((finished_seqs, topk_seqs), 1).gather(1, best[:, :, None].expand(-1, -1, max_new))
        is_finished = torch.cat((is_finished, just_finished), dim=1).gather(1, best)

        best_running = running_scores[:, :1] / ((step + 1) ** length_penalty)
        worst_finished = torch.where(is_finished, finished_scores.min(dim=1, keepdim=True).values, -1e9)
        improvable = improvable & (best_running > worst_finished).any(dim=-1, keepdim=True)
        if not improvable.any() or hits_stop.all():
            break
        reorder = (batch_offset + parent).view(-1)
        state.select_rows(reorder)
        for cache in kv_caches:
            cache.select_rows(reorder)
        state.append(running_seqs[:, :, step].reshape(-1))
        logits = decode(state.tokens, state.positions, state.input_pos, kv_caches, state.decode_mask())
    return finished_seqs[:, 0]
