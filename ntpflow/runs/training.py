"""One deterministic, resumable training loop for every task and regime, and the run directory it writes.

Run directory::

    config.json   env.json   metrics.jsonl   init.safetensors(+.json)   model.safetensors(+.json)   DONE
    ckpt/step_000500.safetensors + step_000500.json    (model and Adam state; the sidecar is written last)

The same config gives bit-identical weights; a killed run resumes from its last checkpoint to the same result.
Training the same config with more ``steps`` into the directory extends the run, to the same bits as a run trained
that long from the start.
"""

import json
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ntpflow.files import (
    DirLock,
    atomic_write,
    ensure_writable_dir,
    environment,
    fault_point,
    read_json,
    resolve_device,
    save_tensors,
    write_json,
)
from ntpflow.model.gpt import GPT
from ntpflow.model.loss import lm_loss
from ntpflow.runs.config import TrainConfig
from ntpflow.runs.data import DataOrder, make_datasets, to_torch
from ntpflow.runs.metrics import MetricsLog, check_sinks, make_sinks
from ntpflow.runs.run import Run, model_config, save_state, task_for
from ntpflow.runs.threads import continue_threads, kept_threads
from ntpflow.tasks import Task

log = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """The loss or the weights became non-finite (NaN or inf): training stopped before saving them."""












@torch.no_grad()
def evaluate(model: GPT, data: dict[str, torch.Tensor], task: Task, chunk: int = 2048) -> dict[str, float]:
    """Eval loss, and where ``data`` has a legal mask: legal-output accuracy and first-output accuracy.

    ``legal_acc`` is, per sequence, the share of counted output predictions (``loss_mask`` true, positions
    ``first_output_pos .. T-2``) whose argmax is legal, averaged over sequences; ``first_acc`` is that of the first.
    """
    was_training = model.training
    model.eval()
    n = len(data["tokens"])
    p0, T = task.first_output_pos, task.seq_len
    loss_sum, legal_hits, first_hits = 0.0, 0.0, 0.0
    for s in range(0, n, chunk):
        tok, mask = data["tokens"][s:s + chunk], data["loss_mask"][s:s + chunk]
        logits = model(tok)
        loss_sum += lm_loss(logits, tok, mask).item() * len(tok)
        if "legal" in data:
            pred = logits[:, p0:T - 1].argmax(-1)  # predictions of the output tokens
            ok = data["legal"][s:s + chunk, p0:T - 1].gather(-1, pred.unsqueeze(-1)).squeeze(-1)
            counted = mask[:, p0:T - 1]
            ok = ok & counted
            legal_hits += (ok.double().sum(1) / counted.double().sum(1).clamp(min=1)).sum().item()
            first_hits += ok[:, 0].double().sum().item()
    model.train(was_training)
    out = {"eval_loss": loss_sum / n}
    if "legal" in data:
        out.update(legal_acc=legal_hits / n, first_acc=first_hits / n)
    return out








def _prepare_run_dir(cfg: TrainConfig, run_dir: Path, *, extend: bool = False) -> None:
    """Create the run dir, or check that an existing one holds the same config (never overwrite another run).
    A run that differs only in having fewer ``steps`` is extended to ``cfg.steps`` (with ``extend``; without it,
    only checked). Every setting is checked before anything is written."""
    resolve_device(cfg.device)  # a bad or unavailable device fails here, not after the first files exist
    if (run_dir / "config.json").exists():
        old = Run.open(run_dir).cfg
        if old.hash() != cfg.hash():
            diff = [k for k, v in cfg.to_dict().items()
                    if old.to_dict().get(k) != v and k not in ("device", "log_every")]
            if diff == ["steps"] and cfg.steps > old.steps:
                _check_extension(Run(run_dir, old))
                if extend:
                    _extend(Run(run_dir, old), cfg)
                return
            raise ValueError(f"{run_dir} holds a run with a different config (differs in: {', '.join(diff)}); "
                             "choose another output directory")
        return
    task = task_for(cfg)
    model = model_config(cfg, task).to_dict()  # validates before anything is written
    ensure_writable_dir(run_dir)
    (run_dir / "ckpt").mkdir(exist_ok=True)
    write_json(run_dir / "config.json", {"train": cfg.to_dict(), "model": model, "config_hash": cfg.hash()})
    write_json(run_dir / "env.json", environment())
    task.save_artifacts(run_dir)  # e.g. the stories task's tokenizer


def train(cfg: TrainConfig, run_dir: str | Path, *, progress: bool = True, track: Sequence = (),
          force_unlock: bool = False, threads: int | None = None) -> Run:
    """Train ``cfg`` into ``run_dir``, resuming from its last good checkpoint if one exists. Returns the Run.

    Metrics go to ``run_dir/metrics.jsonl`` and to the optional ``track`` sinks (``ntpflow.runs.metrics``).
    ``force_unlock`` takes over a lock left by a process on another host (see :class:`~ntpflow.files.DirLock`).
    ``threads``: torch threads on a CPU. ``None`` resumes a run with the count it trained with, so an interrupted
    run ends in the same bits, and starts a fresh one with this process's count (``ntpflow.runs.threads``); the
    caller's count is restored on return.
    A loss or weights becoming non-finite raise :class:`TrainingDiverged` (the checkpoints before stay; no DONE).

    Loss: ``lm_loss`` (mean over positions of the per-position batch-mean cross-entropy). Optimiser: Adam,
    no weight decay, no schedule.
    """
    run_dir = Path(run_dir)
    check_sinks(track)  # missing packages or credentials fail before anything is written
    _prepare_run_dir(cfg, run_dir)
    with DirLock(run_dir, force=force_unlock), kept_threads():  # one writer per run directory
        _prepare_run_dir(cfg, run_dir, extend=True)  # again under the lock: another process may have created it
        return _train(cfg, Run(run_dir, cfg), progress, track, threads)


def _check_extension(run: Run) -> None:
    """Refuse to extend a run whose final weights have been replayed: the attribution would describe other weights."""
    taken = sorted(p.name for p in run.dir.glob("attribution*") if p.is_dir())
    if taken:
        raise ValueError(f"{run.dir} has an attribution of its {run.cfg.steps}-step weights ({', '.join(taken)}); "
                         "move it away before training the run further")


def _extend(run: Run, cfg: TrainConfig) -> None:
    """Turn the finished (or unfinished) ``run`` into a run of ``cfg.steps`` steps that resumes where it stopped.

    Training has no schedule, so steps 0..T of a longer run are exactly the shorter run: its final state becomes
    the checkpoint ``ckpt/step_T`` and its final probes ``probes_T``. Every intermediate state of this function is
    a valid run directory (a kill leaves the old run, unfinished, or the new one), so rerunning completes it."""
    old_steps = run.cfg.steps
    log.info("extending %s from %d to %d steps", run.dir, old_steps, cfg.steps)
    (run.dir / "DONE").unlink(missing_ok=True)
    final = run.dir / "model.safetensors"
    if final.exists():  # the tensors first: a checkpoint counts once its sidecar is there
        ckpt = run.weights_path(old_steps)
        final.replace(ckpt)
        final.with_suffix(".json").replace(ckpt.with_suffix(".json"))
    if (run.dir / "probes").exists():
        (run.dir / "probes").replace(run.dir / f"probes_{old_steps}")
    fault_point("extend:before_config")
    env = read_json(run.dir / "env.json")
    env.setdefault("extensions", []).append({"from_steps": old_steps, "to_steps": cfg.steps, **environment()})
    write_json(run.dir / "env.json", env)
    config = read_json(run.dir / "config.json")
    write_json(run.dir / "config.json", {**config, "train": cfg.to_dict(), "config_hash": cfg.hash()})


def _train(cfg: TrainConfig, run: Run, progress: bool, track: Sequence, threads: int | None) -> Run:
    run_dir = run.dir
    if run.done:
        log.info("%s is already finished", run_dir)
        return run
    device = resolve_device(cfg.device)
    task = run.task
    train_set, eval_set = make_datasets(cfg, task)
    train_data, eval_data = to_torch(train_set, device), to_torch(eval_set, device)
    model = GPT(model_config(cfg, task), seed=cfg.seed)
    if not (run_dir / "init.json").exists():
        save_tensors(run_dir / "init.safetensors", {f"model.{k}": v for k, v in model.state_dict().items()},
                     {"step": 0, "config_hash": cfg.hash()})
    model.to(device).train()
    opt = make_optimizer(model, cfg)
    start = run.resume(model, opt, device)
    if start:
        log.info("resuming %s from step %d", run_dir, start)
    continue_threads([run_dir], start, device, threads)
    _truncate_metrics(run_dir / "metrics.jsonl", start)
    order = DataOrder(cfg.seed, cfg.n_train, cfg.batch_size)
    metrics_file = MetricsLog(run_dir / "metrics.jsonl", make_sinks(track, run_dir, cfg.to_dict()))
    try:
        bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, disable=not progress,
                   desc=run_dir.name, leave=False)
        finite = torch.ones((), dtype=torch.bool, device=device)  # all losses so far finite (checked without a sync)
        checked = start  # the last step known good
        for step in bar:
            if step % cfg.eval_every == 0:
                metrics_file.log({"step": step, "kind": "eval", **_finite_eval(model, eval_data, task, cfg, step)})
            idx = order(step).to(device)
            loss = train_step(model, opt, train_data["tokens"][idx], train_data["loss_mask"][idx])
            finite &= torch.isfinite(loss)
            if (step + 1) % cfg.log_every == 0:
                checked = _check_finite(finite, model, cfg, checked, step + 1, run)
                metrics_file.log({"step": step + 1, "kind": "train", "loss": loss.item()})
                bar.set_postfix(loss=f"{loss.item():.4f}")
            if (step + 1) % cfg.ckpt_every == 0 and step + 1 < cfg.steps:
                checked = _check_finite(finite, model, cfg, checked, step + 1, run)
                metrics_file.flush()
                save_state(run_dir / "ckpt" / f"step_{step + 1:06d}.safetensors", model, opt,
                           {"step": step + 1, "config_hash": cfg.hash()})
                fault_point("train:after_checkpoint")
        _check_finite(finite, model, cfg, checked, cfg.steps, run)
        final = _finite_eval(model, eval_data, task, cfg, cfg.steps)
        metrics_file.log({"step": cfg.steps, "kind": "eval", **final})
    finally:
        metrics_file.close()
    save_state(run_dir / "model.safetensors", model, opt, {"step": cfg.steps, "config_hash": cfg.hash()})
    write_json(run_dir / "DONE", {"step": cfg.steps, **final})
    return run


def _check_finite(finite: torch.Tensor, model: GPT, cfg: TrainConfig, good: int, step: int, run: Run) -> int:
    """Raise :class:`TrainingDiverged` if a loss since step ``good`` or a weight is non-finite; else return ``step``."""
    if bool(finite) and all(bool(torch.isfinite(p).all()) for p in model.parameters()):
        return step
    last = run.checkpoints()
    raise TrainingDiverged(f"training of {run.dir} diverged: the loss or the weights became non-finite between steps "
                           f"{good} and {step} (lr={cfg.lr:g}, beta1={cfg.beta1:g}, beta2={cfg.beta2:g}); "
                           + (f"its last good checkpoint is step {last[-1]}" if last else "no checkpoint was saved")
                           + "; no DONE written")


def _finite_eval(model: GPT, data: dict[str, torch.Tensor], task: Task, cfg: TrainConfig, step: int) -> dict:
    """``evaluate``, refusing a non-finite eval loss (:class:`TrainingDiverged`)."""
    out = evaluate(model, data, task)
    if not np.isfinite(out["eval_loss"]):
        raise TrainingDiverged(f"training diverged: the eval loss at step {step} is {out['eval_loss']} "
                               f"(lr={cfg.lr:g}); no DONE written")
    return out


def train_step(model: GPT, opt: torch.optim.Optimizer, tokens: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """One optimizer step on ``lm_loss``; training and its replay both call this, so they agree bit for bit."""
    loss = lm_loss(model(tokens), tokens, loss_mask)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss


def make_optimizer(model: GPT, cfg: TrainConfig) -> torch.optim.Adam:
    """Adam without weight decay; the fused kernel on CPU and CUDA (one pass over an untied model's many copies)."""
    fused = next(model.parameters()).device.type in ("cpu", "cuda")
    return torch.optim.Adam(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps,
                            fused=fused)


def _truncate_metrics(path: Path, step: int):
    """Drop metric lines that a resumed run from ``step`` writes again: train losses after ``step`` (logged at
    the end of a step) and evaluations from ``step`` on (run at its start), and any half-written line."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec["step"] < step or rec["kind"] == "train" and rec["step"] == step:
            keep.append(line + "\n")
    atomic_write(path, "".join(keep))
