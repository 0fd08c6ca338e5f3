"""LoRA adapters: only they train, merging gives base + low-rank update with unchanged logits, and train.py /
evaluate.py / predict.py run LoRA from out_dir alone, refusing a resume without its base; LoRA on an untrained model
warns. A 16-bit run holds its frozen base in 16 bits, and builds the ROUGE copy one merged weight at a time, tied."""
import copy
import os
import re
import shutil
import types
import weakref

import pytest
import torch
from peft.tuners.lora import LoraLayer
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import GPT2LMHeadModel

import evaluate
import predict
import train
from config import load_config
from conftest import assert_export_matches, metrics, tiny, tiny_gpt
from model import GPT, PRETRAINED, GPTConfig, Targets
from summarizer import inference, loading, memory
from summarizer.checkpoint import load_checkpoint
from summarizer.loading import model_from_checkpoint
from summarizer.preparation import prepare
from summarizer.process import Process

ADAPTED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


@pytest.fixture
def trained_adapter_model():
    """A tiny GPT with rank-2 adapters whose B is no longer zero (as after training), and the base state dict."""
    torch.manual_seed(0)
    model = tiny_gpt(vocab_size=96)
    base = copy.deepcopy(model.state_dict())
    cfg = load_config(["--lora_rank=2", "--lora_alpha=8", "--lora_dropout=0.1"])
    loading.add_adapters(model, **loading.lora_settings(cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(std=0.1)
    return model.eval(), base, cfg


def test_only_adapters_train_and_the_base_is_untouched(trained_adapter_model):
    model, base, _ = trained_adapter_model
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 4 * model.config.n_layer
    assert model.lm_head.weight is model.transformer.wte.weight


def test_merged_weights_are_base_plus_low_rank_update(trained_adapter_model):
    model, base, cfg = trained_adapter_model
    merged = dict(loading.merged_weights(model.state_dict(), **loading.lora_settings(cfg)))
    assert list(merged) == list(base)  # the keys (and order) of a plain GPT: loadable with no adapters
    peft_merged = copy.deepcopy(model)  # the reference: peft's own in-place merge
    for module in peft_merged.modules():
        if isinstance(module, LoraLayer):
            module.merge()
    peft_weights = {n.replace(".base_layer", ""): p for n, p in peft_merged.state_dict().items() if ".lora_" not in n}
    for name, tensor in base.items():
        if name.endswith(ADAPTED):
            change = merged[name] - tensor
            assert torch.equal(merged[name], peft_weights[name]), name
            assert 0 < torch.linalg.matrix_rank(change) <= cfg.lora_rank, name
        else:
            assert torch.equal(merged[name], tensor), name


def test_merged_model_logits_equal_the_adapter_model(trained_adapter_model):
    model, _, cfg = trained_adapter_model
    plain = GPT(model.config)
    plain.load_state_dict(dict(loading.merged_weights(model.state_dict(), **loading.lora_settings(cfg))))
    x = torch.randint(0, 96, (3, 32))
    with torch.no_grad():
        expected, _ = model(x)
        got, _ = plain.eval()(x)
        base_logits, _ = GPT(model.config).eval()(x)
    assert (got - expected).abs().max().item() <= 1e-5
    assert (expected - base_logits).abs().max().item() > 1e-2  # the adapters do change the model


def test_lora_targets_choose_the_layers():
    torch.manual_seed(0)
    model = tiny_gpt(vocab_size=96)
    settings = loading.lora_settings(load_config(["--lora_rank=4", "--lora_targets=attn.c_proj,mlp.c_fc"]))
    loading.add_adapters(model, **settings)
    adapted = sorted({n.split(".lora_")[0] for n, p in model.named_parameters() if p.requires_grad})
    assert adapted == [f"transformer.h.{i}.{t}" for i in range(2) for t in ("attn.c_proj", "mlp.c_fc")]



# ---- the frozen base in the compute dtype, and the ROUGE copy ------------------------------------------------

def test_the_frozen_base_in_16_bits_gives_the_same_loss_and_adapter_gradients(trained_adapter_model):
    """cast_base puts the blocks' frozen Linear layers in the compute dtype, adapters, embeddings and LayerNorms
    stay float32; under autocast the loss and the adapters' gradients are those of the float32 base."""
    model, _, _ = trained_adapter_model
    held = loading.cast_base(copy.deepcopy(model).train(), torch.bfloat16)
    dtypes = {name: p.dtype for name, p in held.named_parameters()}
    assert all(dtype == (torch.bfloat16 if ".base_layer." in name else torch.float32) for name, dtype in dtypes.items())
    x = torch.randint(0, 96, (4, 32))
    y = Targets.of(torch.roll(x, -1, 1))
    losses, grads = [], []
    for m in (model.train(), held):
        torch.manual_seed(0)  # the same lora_dropout masks
        m.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = m(x, y)
        loss.backward()
        losses.append(loss.float())
        grads.append({n: p.grad for n, p in m.named_parameters() if p.requires_grad})
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-2, atol=0)
    assert all(grads[1][n].dtype == torch.float32 for n in grads[1])
    torch.testing.assert_close(grads[1], grads[0], rtol=2e-2, atol=1e-4)


def test_gpt2_xl_with_lora_plans_its_weights_in_16_bits():
    """What micro_batch_size=auto and bench --section=memory count of gpt2-xl's LoRA run in fp16 (5.84 GiB with a
    float32 base)."""
    settings = loading.lora_settings(load_config(["--lora_rank=8"]))
    model = loading.add_adapters(GPT.on_meta(GPTConfig(**PRETRAINED["gpt2-xl"])), **settings)
    weights, _, _ = memory.parameter_bytes(loading.cast_base(model, torch.float16), "ddp", 2)
    assert weights <= 3.5 * 2**30


class NewBytes(TorchDispatchMode):
    """The peak of the bytes held by storages that operators make while it is on (views and in-place results of
    tensors made before do not count)."""

    def __init__(self):
        super().__init__()
        self.held = self.peak = 0
        self.live = set()

    def freed(self, key, size):
        self.live.discard(key)
        self.held -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key not in self.live and key not in inputs:
                    self.live.add(key)
                    self.held += storage.nbytes()
                    weakref.finalize(storage, self.freed, key, storage.nbytes())
        self.peak = max(self.peak, self.held)
        return out


@pytest.mark.parametrize("base_dtype", [torch.float32, torch.bfloat16])
def test_the_rouge_copy_is_filled_one_merged_weight_at_a_time_and_tied(base_dtype):
    """The ROUGE copy of a bf16 LoRA run holds the merged weights in bf16 with wte and lm_head one tensor (half the
    float32 base's bytes), and building it holds little more than the copy: no whole merged state dict."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=128, block_size=64, vocab_size=50257))
    base = memory.nbytes(model.parameters())
    cfg = load_config(["--lora_rank=8"])
    loading.add_adapters(model, **loading.lora_settings(cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(std=0.1)
    loading.cast_base(model, base_dtype)
    proc = types.SimpleNamespace(dtype="bfloat16", backend="none", device=torch.device("cpu"),
                               parallel=types.SimpleNamespace(full_weights=lambda m: m.state_dict()))
    with NewBytes() as built:
        rouge = inference.rouge_model(model, cfg, proc)
    held = memory.nbytes(rouge.state_dict().values())
    assert rouge.lm_head.weight is rouge.transformer.wte.weight
    assert held == 2 * sum(p.numel() for p in rouge.parameters()) and held <= 0.52 * base
    assert built.peak <= 0.65 * base
    merged = dict(loading.merged_weights(model.state_dict(), **loading.lora_settings(cfg)))
    assert all(torch.equal(tensor, merged[name].bfloat16()) for name, tensor in rouge.state_dict().items())


# ---- training with LoRA: train.py, then evaluate.py/predict.py from out_dir alone --------------------------

# init_from and the shape come from the base model (lora_args)
LORA = [*tiny(init_from=None, n_layer=None, n_head=None, n_embd=None), "--log_interval=1", "--warmup_iters=2",
        "--learning_rate=1e-2", "--batch_size=8", "--micro_batch_size=4", "--eval_interval=3", "--lr_decay_iters=6",
        "--rouge_samples=2", "--dropout=0.1",
        "--lora_rank=4", "--lora_dropout=0.1", "--gradient_checkpointing=True", "--sample_submission_csv="]


@pytest.fixture
def base_dir(tiny_hf_dir, tmp_path):
    """A copy of the tiny transformers model, which a test may delete."""
    return shutil.copytree(tiny_hf_dir, tmp_path / "base")


@pytest.fixture
def lora_args(write_csv, tmp_path, base_dir):
    return [*LORA, f"--init_from={base_dir}", f"--train_csv={write_csv('train.csv', 40)}",
            f"--test_csv={write_csv('test.csv', 5, seed=7, test=True)}", f"--data_cache_dir={tmp_path / 'cache'}"]


@pytest.mark.slow
def test_lora_training_changes_only_the_adapters_and_best_pt_is_merged(lora_args, base_dir, tmp_path):
    out = tmp_path / "out"
    train.main([*lora_args, "--max_iters=6", f"--out_dir={out}"])
    base = GPT.from_pretrained(str(base_dir)).state_dict()
    trained = load_checkpoint(str(out / "ckpt.pt"))["model"]
    assert trained and all(".lora_" in k and not torch.equal(v, torch.zeros_like(v)) for k, v in trained.items())
    best = load_checkpoint(str(out / "best.pt"))["model"]
    assert list(best) == list(base)
    # ckpt.pt read by evaluate.py/predict.py/export.py (--ckpt=.../ckpt.pt): its base rebuilt, adapters merged
    plain = model_from_checkpoint(load_checkpoint(str(out / "ckpt.pt")), "ckpt.pt")
    assert list(plain.state_dict()) == list(base)
    assert all(torch.equal(v, best[k]) for k, v in plain.state_dict().items())
    for name, tensor in base.items():
        if name.endswith(ADAPTED):
            assert 0 < torch.linalg.matrix_rank(best[name] - tensor) <= 4, name
        else:
            assert torch.equal(best[name], tensor), name


@pytest.mark.slow
def test_evaluate_and_predict_run_from_out_dir_with_the_base_model_deleted(lora_args, base_dir, tmp_path):
    out = tmp_path / "out"
    train.main([*lora_args, "--max_iters=3", f"--out_dir={out}"])
    shutil.rmtree(base_dir)
    predict.main([*lora_args, f"--out_dir={out}"])
    with open(out / "submission.csv") as f:
        assert len(f.read().strip().splitlines()) == 1 + 5
    evaluate.main([*lora_args, f"--out_dir={out}"])
    assert (out / "eval_metrics.json").exists()
    assert_export_matches(out / "best.pt", tmp_path / "exported")  # merged weights: a plain transformers GPT-2


@pytest.mark.slow
def test_lora_ckpt_keeps_the_adapters_and_a_reference_to_its_base(lora_args, base_dir, tmp_path):
    """ckpt.pt holds the adapters and their AdamW state, not the frozen base: under a quarter of the base's
    weight bytes even for a tiny model; resuming from it is bit-identical to one uninterrupted run."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    train.main([*lora_args, "--max_iters=6", f"--out_dir={whole}"])
    train.main([*lora_args, "--max_iters=3", f"--out_dir={split}"])
    assert os.path.getsize(split / "ckpt.pt") < os.path.getsize(base_dir / "model.safetensors") / 4
    train.main([*lora_args, "--max_iters=6", f"--out_dir={split}", "--init_from=resume"])
    assert [r["loss"] for r in metrics(split)] == [r["loss"] for r in metrics(whole)]
    for name in ("ckpt.pt", "best.pt"):
        got, expected = load_checkpoint(str(split / name))["model"], load_checkpoint(str(whole / name))["model"]
        assert list(got) == list(expected) and all(torch.equal(got[k], expected[k]) for k in got), name


@pytest.mark.slow
def test_a_16_bit_lora_run_holds_its_base_in_16_bits_and_resumes(lora_args, tmp_path):
    """fp16 with a GradScaler (a T4's precision): the model a run trains holds its frozen base in fp16, the adapters
    and AdamW's state in float32; ckpt.pt keeps the hash of the base as loaded (float32), so a float32 run's ckpt.pt
    resumes in fp16 and an fp16 run's in float32; best.pt's merged weights are float32."""
    args = [*lora_args, "--eval_interval=2", "--rouge_samples=1", "--dropout=0.0", "--lora_dropout=0.0"]
    train.main([*args, "--max_iters=2", f"--out_dir={tmp_path / 'fp32'}"])
    train.main([*args, "--dtype=float16", "--max_iters=2", f"--out_dir={tmp_path / 'fp16'}"])
    sha = {run: load_checkpoint(str(tmp_path / run / "ckpt.pt"))["lora_base"]["sha256"] for run in ("fp32", "fp16")}
    assert sha["fp16"] == sha["fp32"]
    cfg = load_config([*args, "--dtype=float16", "--max_iters=4", f"--out_dir={tmp_path / 'fp32'}",
                       "--init_from=resume"])
    proc = Process(cfg)
    trainer = train.Trainer(prepare(cfg, proc), proc)
    state = trainer.setup.state
    dtypes = {name: p.dtype for name, p in state.model.named_parameters()}
    assert {dtypes[n] for n in dtypes if ".base_layer." in n} == {torch.float16}
    assert {dtypes[n] for n in dtypes if ".base_layer." not in n} == {torch.float32}
    trainer.fit()
    assert {t.dtype for s in state.optimizer.state.values() for t in s.values() if t.dim()} == {torch.float32}
    ckpt = load_checkpoint(str(tmp_path / "fp32" / "ckpt.pt"))
    assert ckpt["iter_num"] == 4 and ckpt["lora_base"]["sha256"] == sha["fp32"] and ckpt["scaler"]
    assert {t.dtype for t in load_checkpoint(str(tmp_path / "fp32" / "best.pt"))["model"].values()} == {torch.float32}
    train.main([*args, "--max_iters=4", f"--out_dir={tmp_path / 'fp16'}", "--init_from=resume"])
    assert load_checkpoint(str(tmp_path / "fp16" / "ckpt.pt"))["iter_num"] == 4

def error_lines(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith(("error", "warning"))]


@pytest.mark.slow
def test_lora_resume_without_its_base_or_with_another_is_one_line(lora_args, base_dir, tmp_path, capsys):
    out = tmp_path / "out"
    train.main([*lora_args, "--max_iters=3", f"--out_dir={out}"])
    moved = shutil.move(str(base_dir), str(tmp_path / "moved"))
    with pytest.raises(SystemExit) as stopped:
        train.main([*lora_args, "--max_iters=6", f"--out_dir={out}", "--init_from=resume"])
    lines = error_lines(capsys)
    assert stopped.value.code == 2 and len(lines) == 1 and "holds LoRA adapters" in lines[0], lines
    assert f"cannot be loaded from {base_dir}" in lines[0]
    # the hint, followed literally with the base's new place, resumes (at the end of this test)
    hinted = re.search(r"continue with (--resume_from=\S+) --init_from=<where the base is now", lines[0])[1]
    changed = GPT2LMHeadModel.from_pretrained(moved)
    with torch.no_grad():
        changed.transformer.h[0].mlp.c_fc.weight[0, 0] += 1.0
    changed.save_pretrained(tmp_path / "changed")
    with pytest.raises(SystemExit):
        train.main([*lora_args, "--max_iters=6", f"--out_dir={out}", f"--resume_from={out / 'ckpt.pt'}",
                    f"--init_from={tmp_path / 'changed'}"])
    lines = error_lines(capsys)
    assert len(lines) == 1 and "trained on another base model" in lines[0] and "sha256" in lines[0], lines
    # the base where it is now: resumes
    train.main([*lora_args, "--max_iters=6", f"--out_dir={out}", hinted, f"--init_from={moved}"])
    assert load_checkpoint(str(out / "ckpt.pt"))["iter_num"] == 6


def test_lora_on_an_untrained_model_warns(write_csv, tmp_path, capfd):
    train.main([*tiny(), f"--train_csv={write_csv('train.csv', 48)}", f"--data_cache_dir={tmp_path / 'c'}",
                f"--out_dir={tmp_path / 'out'}", "--batch_size=8", "--micro_batch_size=8", "--sample_submission_csv=",
                "--max_iters=1", "--lora_rank=4", "--rouge_samples=0", "--best_metric=val_loss"])
    err = capfd.readouterr().err
    assert any(line.startswith("warning: ") and "lora_rank=4" in line and "init_from=scratch" in line
               for line in err.splitlines()), err
