"""train.py: every launcher trains the same model (and under torchrun leaves nothing holding the process group at its
teardown), resume is bit-identical, checkpoints are complete, the pipeline learns its training set, and the demo says
what runs before it trains. A SIGKILL mid-write: tests/test_crash_safety.py;
a checkpoint whose pickle runs code: tests/test_bad_inputs.py."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import conftest
import train
from conftest import HANG, REPO, free_port, metrics, run, save_csv, synthetic_rows, torchrun
from summarizer.checkpoint import load_checkpoint

RUN = [*conftest.TINY, "--log_interval=1", "--warmup_iters=2", "--learning_rate=3e-3"]
PARITY = [*RUN, "--batch_size=16", "--max_iters=6", "--eval_interval=3", "--rouge_samples=4", "--dropout=0.0"]


def assert_same_losses(got, expected, rel=1e-4):
    assert [r["iter"] for r in got] == [r["iter"] for r in expected]
    for g, e in zip(got, expected, strict=True):
        for key in ("loss", "val_loss", "rougeL"):
            if key in e:
                assert g[key] == pytest.approx(e[key], rel=rel), (key, g["iter"])


@pytest.fixture(scope="module")
def parity_data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("parity")
    save_csv(folder / "train.csv", synthetic_rows(120, seed=1))
    save_csv(folder / "test.csv", synthetic_rows(6, seed=2), test=True)
    return folder


@pytest.fixture(scope="module")
def single_process(parity_data):
    out = parity_data / "single"
    train.main([*PARITY, f"--train_csv={parity_data / 'train.csv'}", f"--data_cache_dir={parity_data / 'cache'}",
                "--micro_batch_size=4", f"--out_dir={out}"])
    return metrics(out)


# torchrun's launches run train.py under tests/teardown_probe.py, which reports what is alive as each rank destroys
# its process group, its NCCL variables and the DDP modules built; DDP's runs the default Kaggle preset (its
# nccl_p2p_disable) and also evaluates and predicts after training (what evaluate.py and predict.py run)
PROBED = ("--nproc_per_node=2", "--standalone", "tests/teardown_probe.py", "train.py")
LAUNCHES = {
    "micro_batch_2": lambda args: [sys.executable, "train.py", *args, "--micro_batch_size=2"],
    "torchrun_ddp": lambda args: torchrun(*PROBED, "config/kaggle_t4x2.py", *args, "--micro_batch_size=4",
                                          "--evaluate_after=True", "--predict_after=True"),
    "torchrun_fsdp_checkpointing": lambda args: torchrun(*PROBED, *args, "--micro_batch_size=4", "--backend=fsdp",
                                                         "--gradient_checkpointing=True"),
    "torchrun_accelerate": lambda args: torchrun(*PROBED, *args, "--micro_batch_size=4", "--backend=accelerate"),
    "notebook_launcher": lambda args: [sys.executable, "-c", textwrap.dedent(f"""
        import train
        train.notebook_main({[*args, "--micro_batch_size=2"]!r}, num_processes=2, port={free_port()})
        """)],
}


@pytest.mark.slow
@pytest.mark.parametrize("launch", LAUNCHES)
def test_every_launcher_trains_the_same_model(parity_data, single_process, launch):
    """Single process with accumulation == 2 DDP ranks == 2 FSDP ranks (with gradient checkpointing) == 2 Accelerate
    ranks == notebook_launcher, loss for loss. Under torchrun, each rank's DDP or FSDP module, and every model, is
    gone when its process group is destroyed (a gloo group whose last holder is DDP's Reducer can deadlock at the
    interpreter's exit; tests/test_teardown.py); DDP's buckets, ours and Accelerate's, are the gradients
    (gradient_as_bucket_view); the Kaggle preset's ranks start NCCL without cuMem host buffers, as T4s need."""
    out = parity_data / launch
    args = [*PARITY, f"--train_csv={parity_data / 'train.csv'}", f"--test_csv={parity_data / 'test.csv'}",
            f"--data_cache_dir={parity_data / 'cache'}", f"--out_dir={out}"]
    result = run(LAUNCHES[launch](args))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_losses(metrics(out), single_process)
    if launch.startswith("torchrun"):
        reports = [line for line in result.stderr.splitlines() if line.startswith("alive at teardown:")]
        assert reports == ["alive at teardown: ddp=0 fsdp=0 gpt=0"] * 2, result.stderr[-3000:]
        # counted in the whole stream: another rank's progress bar may leave its line unfinished before a report
        assert result.stderr.count("ddp built: ") == result.stderr.count("ddp built: gradient_as_bucket_view=True") \
            == 2 * (launch != "torchrun_fsdp_checkpointing"), result.stderr[-3000:]
    if launch == "torchrun_ddp":
        nccl = [line for line in result.stderr.splitlines() if line.startswith("nccl at teardown:")]
        assert nccl == ["nccl at teardown: NCCL_CUMEM_HOST_ENABLE=0 NCCL_P2P_DISABLE=1"] * 2, result.stderr[-3000:]
    if launch == "torchrun_ddp":  # the after-run ran before the teardown it reported on
        assert (out / "eval_metrics.json").is_file() and (out / "submission.csv").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("mode", [[], ["--lora_rank=4", "--lora_dropout=0.1", "--gradient_checkpointing=True"]],
                         ids=["full", "lora"])
def test_exact_resume_is_bit_identical(write_csv, tmp_path, mode):
    csv = write_csv("train.csv", 80)
    common = [*RUN, f"--train_csv={csv}", f"--data_cache_dir={tmp_path / 'cache'}", "--batch_size=8",
              "--micro_batch_size=4", "--eval_interval=4", "--lr_decay_iters=8", "--rouge_samples=2",
              "--dropout=0.1", *mode]
    train.main([*common, "--max_iters=8", f"--out_dir={tmp_path / 'straight'}"])
    train.main([*common, "--max_iters=4", f"--out_dir={tmp_path / 'resumed'}"])
    train.main([*common, "--max_iters=8", f"--out_dir={tmp_path / 'resumed'}", "--init_from=resume"])
    straight = load_checkpoint(str(tmp_path / "straight" / "ckpt.pt"))
    resumed = load_checkpoint(str(tmp_path / "resumed" / "ckpt.pt"))
    assert resumed["iter_num"] == straight["iter_num"] == 8
    for name, tensor in straight["model"].items():
        assert torch.equal(tensor, resumed["model"][name]), name
    assert [r["loss"] for r in metrics(tmp_path / "resumed")] == [r["loss"] for r in metrics(tmp_path / "straight")]


def test_checkpoint_has_clean_keys_and_everything_to_resume(write_csv, tmp_path):
    csv = write_csv("train.csv", 40)
    train.main([*RUN, f"--train_csv={csv}", f"--data_cache_dir={tmp_path / 'cache'}", "--batch_size=8",
                "--micro_batch_size=4", "--max_iters=2", "--eval_interval=2", "--rouge_samples=2",
                f"--out_dir={tmp_path}"])
    ckpt = load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert {"model", "model_args", "optimizer", "scaler", "iter_num", "config", "rng"} <= set(ckpt)
    assert not any(k.startswith(("_orig_mod.", "module.")) for k in ckpt["model"])
    assert os.path.exists(tmp_path / "best.pt") and os.path.exists(tmp_path / "metrics.png")


@pytest.mark.slow
def test_the_pipeline_learns_its_training_set(write_csv, tmp_path):
    """A tiny model fine-tuned on 64 dialogues summarizes those same dialogues almost perfectly."""
    csv = write_csv("train.csv", 64)
    train.main([f"--train_csv={csv}", f"--validation_csv={csv}", f"--out_dir={tmp_path}",
                f"--data_cache_dir={tmp_path / 'cache'}", "--init_from=scratch", "--device=cpu", "--dtype=float32",
                "--compile=False", "--n_layer=2", "--n_head=2", "--n_embd=64", "--block_size=128",
                "--max_new_tokens=24", "--batch_size=16", "--micro_batch_size=16", "--max_iters=150",
                "--eval_interval=150", "--learning_rate=1e-2", "--min_lr=1e-3", "--warmup_iters=5",
                "--weight_decay=0", "--rouge_samples=64", "--gen_batch_size=64", "--log_interval=1000"])
    final = metrics(tmp_path)[-1]
    assert final["rougeL"] >= 0.95, final


@pytest.mark.slow
def test_two_nodes_on_localhost_equal_two_processes_on_one_node(parity_data, single_process):
    """torchrun's c10d rendezvous as 2 nodes x 1 process (what several machines run) trains exactly what
    1 node x 2 processes does, and the same as one process; both DDP with gradient checkpointing."""
    args = [*PARITY, f"--train_csv={parity_data / 'train.csv'}", f"--data_cache_dir={parity_data / 'cache'}",
            "--micro_batch_size=4", "--gradient_checkpointing=True"]
    one_node = run(torchrun("--nproc_per_node=2", "--standalone", "train.py", *args,
                            f"--out_dir={parity_data / 'one_node'}"))
    assert one_node.returncode == 0, one_node.stderr[-3000:]
    endpoint = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    nodes = [subprocess.Popen(torchrun("--nnodes=2", "--nproc_per_node=1", f"--node_rank={rank}",
                                       "--rdzv_id=test", "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}",
                                       "--rdzv_conf=join_timeout=60", "--local_addr=127.0.0.1", "--max_restarts=0",
                                       "train.py", *args, f"--out_dir={parity_data / 'two_nodes'}"),
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    try:
        outputs = [node.communicate(timeout=HANG) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, (_, stderr) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, stderr[-3000:]
    assert sum("over 2 process(es)" in stdout for stdout, _ in outputs) == 1  # one job of 2 ranks, logged by rank 0
    two_nodes = metrics(parity_data / "two_nodes")
    assert [r["loss"] for r in two_nodes] == [r["loss"] for r in metrics(parity_data / "one_node")]
    assert_same_losses(two_nodes, single_process)


@pytest.mark.slow
def test_the_demo_says_what_runs_in_a_few_lines_before_it_trains(tmp_path):
    """Before the first training line: the keys the preset and the command line changed (named, with where each
    came from), the notes and the line that says what runs, the disk plan; not every key of the config."""
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "train.py", "config/demo.py", "--max_iters=1", "--eval_interval=1",
                             "--rouge_samples=1", f"--out_dir={out}", f"--data_cache_dir={tmp_path / 'cache'}",
                             "--evaluate_after=False", "--predict_after=False"], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            timeout=HANG)
    assert result.returncode == 0, result.stdout
    # progress bars aside: a slower machine draws more of their updates
    lines = [line for line in result.stdout.replace("\r", "\n").splitlines()
             if line.startswith("training:") or "%|" not in line and line.strip()]
    first = next(i for i, line in enumerate(lines) if line.startswith("training:"))
    assert first <= 16, lines[:first]
    start = next(i for i, line in enumerate(lines[:first]) if line.startswith("settings ("))
    assert f"every key in {out / 'config.json'} before step 1" in lines[start] and (out / "config.json").is_file()
    sources = {}  # each source's lines ("  config/demo.py: Group: key=value ..." and "    ..." after it), joined
    for line in lines[start + 1:first]:
        if not line.startswith("  "):
            break
        if line.startswith("    "):
            sources[list(sources)[-1]] += " " + line.strip()
        else:
            source, _, text = line.strip().partition(": ")
            sources[source] = text
    assert list(sources) == ["config/demo.py", "command line"]
    assert "Paths: init_from='scratch'" in sources["config/demo.py"] and "max_iters" not in sources["config/demo.py"]
    assert "Training: max_iters=1" in sources["command line"]
    assert not any(line.startswith("learning_rate ") for line in lines[:first])  # no key-per-line listing
