"""GPT-2 in nanoGPT's shape, loadable from transformers, with the KV caches that decoding (generate.py) writes."""
import math
import os
from dataclasses import dataclass
from typing import NamedTuple

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


class Targets(NamedTuple):
    """Training targets y (B, T; -1 = ignore) with the positions of y.view(-1) that are trained on."""
    y: torch.Tensor
    index: torch.Tensor

    @classmethod
    def of(cls, y):
        """Found where y is made, on the host, so that no shape in a compiled training step depends on data."""
        return cls(y, (y.view(-1) != -1).nonzero().squeeze(1))

    def to(self, device):
        return Targets(self.y.to(device, non_blocking=True), self.index.to(device, non_blocking=True))


class KVCache:
    """One layer's keys and values, kv (rows, 2, heads, slots, head_dim): a step writes both in one copy."""

    def __init__(self, slots, kv=None):
        self.slots, self.kv = slots, kv

    def update(self, input_pos, kv):
        self.kv.index_copy_(3, input_pos, kv)
        return self.kv.unbind(1)

    def attend(self, q, input_pos, kv, mask):
        return F.scaled_dot_product_attention(q, *self.update(input_pos, kv), attn_mask=mask)

    def write_prompts(self, kv, lengths):
        """Prompts packed along kv (1, 2, H, sum(lengths), D), a row each, right-aligned at their prompt_ends."""
        self.kv = kv.new_zeros(len(lengths), *kv.shape[1:3], self.slots, kv.size(4))
        for row, (prompt, end) in enumerate(zip(kv.split(lengths, 3), self.prompt_ends(lengths), strict=True)):
            self.kv[row, :, :, end - prompt.size(3):end] = prompt[0]

    def prompt_ends(self, lengths):
        return [max(lengths)] * len(lengths)

    def select_rows(self, rows):
        return type(self)(self.slots, self.kv[rows])


def prompt_slots(length):
    """A shared prompt's slots: its length (int or tensor) up to a multiple of 16, so near lengths share a call."""
    return -(-length // 16) * 16


class SharedPromptCache(KVCache):
    """n rows (beams, samples) a prompt: its row holds the prompt in prompt_slots, then row j's token t at slot
    prompt_slots + t * n + j. A step reads a prompt once, in its dtype, its keys independent of the batch."""

    def prompt_ends(self, lengths):
        return [prompt_slots(n) for n in lengths]

    def attend(self, q, input_pos, kv, masks):
        """One SDPA call a run of prompts alike, as its mask (prompts, 1, rows a prompt, slots) in `masks` allows."""
        self.kv[input_pos[0], :, :, input_pos[1]] = kv[:, :, :, 0]
        (_, H, _, D), ys, first = q.shape, [], 0
        for mask in masks:
            prompts, _, n, slots = mask.shape
            k, v = self.kv[first:first + prompts, :, :, :slots].unbind(1)
            q_run = q[first * n:(first + prompts) * n].reshape(prompts, n, H, D).transpose(1, 2)
            y = F.scaled_dot_product_attention(q_run, k, v, attn_mask=mask)
            ys.append(y.transpose(1, 2).reshape(-1, H, 1, D))
            first += prompts
        return torch.cat(ys)


def attention_mask(allowed, dtype):
    """The additive mask (rows, 1, 1, slots) of a boolean (rows, slots): 0 where allowed, -inf elsewhere."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, -math.inf)[:, None, None]


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
        """Causal attention; with `lengths`, x (1, T, C) holds prompts packed back to back, each to its cache row."""
        B, T, C = x.size()
        qkv = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head)
        q, kv = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1:].permute(0, 2, 3, 1, 4)  # kv (B, 2, heads, T, head_dim)
        if lengths is not None:
            kv_cache.write_prompts(kv, lengths)
            y = torch.cat([F.scaled_dot_product_attention(q, *kv.unbind(1), is_causal=True)
                           for q, kv in zip(q.split(lengths, 2), kv.split(lengths, 3), strict=True)], dim=2)
        elif kv_cache is None:  # training
            y = F.scaled_dot_product_attention(q, *kv.unbind(1), dropout_p=self.dropout if self.training else 0.0,
                                               is_causal=True)
        else:
            y = kv_cache.attend(q, input_pos, kv, mask)
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
        self.tie_weights()
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        self.gradient_checkpointing = False  # set by the trainer (config key gradient_checkpointing)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self):
        return sum(p.numel() for p in self.parameters()) - self.transformer.wpe.weight.numel()  # nanoGPT's count

    def training_flops(self, tokens, targets, attended):
        """A training step's model FLOPs: lm_head at the `targets` only (as forward computes), attention over
        `attended` = the sum of squared sequence lengths."""
        head = self.lm_head.weight.numel()
        return (6 * (self.num_params() - head) * tokens + 6 * head * targets
                + 12 * self.config.n_layer * self.config.n_embd * attended)

    def forward(self, idx, targets=None):
        """(logits of every position, None), or with targets (-1 = ignore, or Targets): (None, mean loss), only the
        supervised positions through lm_head (a summary is ~15% of a training row)."""
        T = idx.size(1)
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
        y, index = targets if isinstance(targets, Targets) else Targets.of(targets)
        logits = self.lm_head(x.flatten(0, 1).index_select(0, index))
        loss = F.cross_entropy(logits.float(), y.view(-1).index_select(0, index), reduction="sum")
        return None, loss / max(index.numel(), 1)

    def next_logits(self, idx, positions, input_pos, kv_caches, mask, rows=None):
        """A decode step's logits (of `rows` only, if given): idx (B, 1) written to the caches at input_pos."""
        x = self.transformer.wte(idx) + self.transformer.wpe(positions)
        for block, cache in zip(self.transformer.h, kv_caches, strict=True):
            x = block(x, cache, input_pos, mask)
        x = self.transformer.ln_f(x[:, -1] if rows is None else x[rows, -1])
        if x.device.type == "cpu" and x.size(0) < 64:  # a CPU's BLAS: 1.3-1.7x faster below 64 rows
            return (self.lm_head.weight @ x.t()).t()
        return self.lm_head(x)

    def prefill(self, prompts, kv_caches):
        """Each prompt's last logits, the prompts packed in one sequence (no compute on padding), caches filled."""
        device = self.lm_head.weight.device
        lengths = [len(p) for p in prompts]
        idx = torch.tensor([[t for p in prompts for t in p]], device=device)
        positions = torch.cat([torch.arange(n, device=device) for n in lengths])
        x = self.transformer.wte(idx) + self.transformer.wpe(positions)
        for block, cache in zip(self.transformer.h, kv_caches, strict=True):
            x = block(x, cache, lengths=lengths)
        last = torch.tensor(lengths, device=device).cumsum(0) - 1
        return self.lm_head(self.transformer.ln_f(x[0, last]))

    def set_dropout(self, p):
        """Change the dropout probability everywhere (a resumed run may train with another one)."""
        self.config.dropout = p
        self.transformer.drop.p = p
        for block in self.transformer.h:  # these only: LoRA adapters keep their own dropout (lora_dropout)
            block.attn.resid_dropout.p = block.mlp.dropout.p = block.attn.dropout = p

    def crop_block_size(self, block_size):
        """Shrink the context window, keeping the first position embeddings."""
        assert block_size <= self.config.block_size
        self.config.block_size = block_size
        self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size])

    @classmethod
    def from_pretrained(cls, name_or_path, dropout=0.0, local_files_only=False):
        """GPT-2 weights from transformers: a hub name (gpt2 .. gpt2-xl) or a save_pretrained directory."""
        import transformers
        from transformers import GPT2LMHeadModel

        # float32 whatever the files hold; transformers 4.56 renamed torch_dtype to dtype (the old name warns from
        # then on) and requirements.txt allows 4.43
        major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
        dtype = {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": torch.float32}
        if name_or_path not in PRETRAINED and not os.path.isdir(name_or_path):
            raise FileNotFoundError(
                f"{name_or_path!r} is neither one of {', '.join(PRETRAINED)} nor a local directory")
        try:
            hf = GPT2LMHeadModel.from_pretrained(name_or_path, **dtype, local_files_only=local_files_only)
        except OSError as e:
            raise FileNotFoundError(f"could not load GPT-2 weights from {name_or_path!r}: {e}") from None
        hf_config = hf.config
        config = GPTConfig(block_size=hf_config.n_positions, vocab_size=hf_config.vocab_size,
                           n_layer=hf_config.n_layer, n_head=hf_config.n_head, n_embd=hf_config.n_embd,
                           dropout=dropout, bias=True)
        sd_hf = hf.state_dict()
        del hf  # from here the dict holds transformers' tensors: each is freed once taken from it
        model, state = cls.on_meta(config), {}
        for name in model.state_dict():
            tensor = sd_hf.pop(name, None)
            tensor = state["transformer.wte.weight"] if tensor is None else tensor  # tied: listed once
            state[name] = tensor.t().contiguous() if name.endswith(CONV1D_WEIGHTS) else tensor
        # the model holds these tensors themselves (no copy, no random initialization first): about one copy of
        # the weights in host memory
        model.load_state_dict(state, assign=True)
        model.tie_weights()
        return model

    @classmethod
    def on_meta(cls, config):
        with torch.device("meta"):
            return cls(config)

    def tie_weights(self):
        """wte and lm_head share one weight (again after load_state_dict(assign=True), which assigns each name)."""
        self.transformer.wte.weight = self.lm_head.weight
