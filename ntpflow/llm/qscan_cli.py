"""``ntpflow qscan``: Q(w) of SAE latents of a language model, by ablation (docs/paper.md#q): the command line over
the stages of :mod:`ntpflow.llm.stages`, which ``ntpflow reproduce llm`` runs too.

    ntpflow qscan --model smollm2 --train-sae --latents 96 --out runs/qscan     # corpus, SAE, scan
    ntpflow qscan --model smollm2 --sae runs/llm/sae --latents 256 --out runs/qscan2 --mode reconstruction
    ntpflow qscan train --out runs/llm    # corpus, SAE and its quality only
    ntpflow qscan scan --out runs/llm     # the scan of runs/llm's SAE over its corpus

Writes ``OUT/contexts.safetensors`` (+ ``contexts.json``), ``OUT/sae/`` and ``OUT/quality.json`` (when it trains an
SAE), ``OUT/q_<mode>.json`` and ``OUT/stats.json`` (when it scans). ``main(argv)`` returns the exit code; errors are
one line on stderr.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from ntpflow.files import ensure_writable_dir, resolve_device
from ntpflow.llm.adapters import MODELS, load_model
from ntpflow.llm.corpus import user_documents
from ntpflow.llm.qscan import MODES, QScanConfig
from ntpflow.llm.sae import load_sae
from ntpflow.llm.stages import LLMDir, fit_sae, make_contexts, save_sae_stage, save_scan, scan

STEPS = {None: "Q(w) of SAE latents of a language model, by ablation: corpus, SAE (trained or given), scan "
               "(`ntpflow qscan train|scan -h`: either half alone)",
         "train": "the corpus and an SAE trained on it, with its quality on train and held-out activations",
         "scan": "Q(w) of the SAE of OUT (from `ntpflow qscan train`) over OUT's corpus, and the statistics"}

EPILOG = """examples:
  ntpflow qscan --model tiny --train-sae --latents 8 --docs 8 --steps 50 --out runs/qscan-tiny   # seconds, no download
  ntpflow qscan --model smollm2 --train-sae --latents 96 --out runs/qscan
  ntpflow qscan --model smollm2 --sae runs/qscan/sae --latents 256 --mode reconstruction --out runs/qscan2
  ntpflow qscan train --out runs/llm && ntpflow qscan scan --latents 256 --out runs/llm   # the two halves

Python equivalent:
  from ntpflow.llm.qscan_cli import main; main(["--model", "tiny", "--train-sae", "--out", "runs/qscan-tiny"])
  (the stages: ntpflow.llm.stages.make_contexts, fit_sae, scan; the scan itself: ntpflow.llm.qscan.q_scan)

A latent is included in the statistics when it has at least one usable example (active in some context with
the scan's 10 future predictions after it) and its mean total KL over them exceeds --kl-cutoff; the summary line
says how many latents fail each condition."""

SAE_DEFAULTS = {"simple": (256, 3e-3), "topk": (512, 4e-4), "standard": (512, 4e-4)}
"""(batch size, learning rate) of a trained SAE by kind, unless --batch-size / --lr say otherwise."""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Each option's default after its help text (unless it names its default itself); the epilog's examples keep
    their line breaks."""

    def _get_help_string(self, action):
        text = action.help or ""
        if not any(action.default is x for x in (None, False, argparse.SUPPRESS)) and "default" not in text:
            text += " (default: %(default)s)"
        return text


def _parser(step: str | None) -> argparse.ArgumentParser:
    """The options of ``ntpflow qscan`` (``step`` None), ``ntpflow qscan train`` or ``ntpflow qscan scan``."""
    ap = argparse.ArgumentParser(prog="ntpflow qscan" + (f" {step}" if step else ""), description=STEPS[step],
                                 epilog=EPILOG, formatter_class=_Formatter)
    ap.add_argument("--model", default="smollm2",
                    help=f"{' | '.join(MODELS)} (smollm2: SmolLM2-135M-Instruct offline; tiny: a random 2-layer "
                         "GPT-2 over bytes, for tests) | a local folder (a HookedTransformer saved by "
                         "ntpflow.llm.adapters.save_hooked_transformer, or a Hugging Face model's save_pretrained) | "
                         "a TransformerLens or Hugging Face model name (needs the hub or its cache)")
    ap.add_argument("--hook", help="the site scanned, a hook name (default: the SAE's own hook_name from its "
                    "cfg.json, else the model's middle blocks.N.hook_resid_post)")
    if step is None:
        src = ap.add_mutually_exclusive_group(required=True)
        src.add_argument("--sae", metavar="DIR", help="an SAE folder (SAELens layout: sae_weights.safetensors + "
                         "cfg.json)")
        src.add_argument("--sae-release", metavar="RELEASE", help="an SAELens pretrained release (with --sae-id; "
                         "needs the hub or its cache)")
        src.add_argument("--train-sae", action="store_true", help="train an SAE on the corpus first")
        ap.add_argument("--sae-id", help="the SAE's id within --sae-release")
    ap.add_argument("--out", required=True, help="output folder" + (" (holding `qscan train`'s corpus and SAE)"
                                                                   if step == "scan" else ""))
    if step != "scan":
        _corpus_options(ap)
        _sae_options(ap)
    if step != "train":
        _scan_options(ap)
    ap.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda, cuda:1, ...")
    ap.add_argument("--seed", type=int, default=0, help="seed of the corpus, the SAE and the latent subset")
    return ap


def _corpus_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--docs", type=int, default=100, help="documents per domain (stories, code, math, or --domains)")
    ap.add_argument("--domains", metavar="LABEL:PATH,...",
                    help="your own domains instead of stories, code and math: each a text file (documents separated "
                         "by blank lines) or a folder of .txt files, e.g. news:news.txt,legal:legal/")
    ap.add_argument("--formal", metavar="LABEL,...", help="which of --domains count as formal (default: none)")
    ap.add_argument("--stories", metavar="DIR", default=None,
                    help="a folder of TinyStories .txt files for the stories domain (default: generated stories)")
    ap.add_argument("--ctx-len", type=int, default=64, help="tokens per context window")
    ap.add_argument("--windows", type=int, default=2, help="context windows per document at most")


def _sae_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--d-sae", type=int, default=2048, help="latents of a trained SAE")
    ap.add_argument("--k", type=int, default=32, help="TopK sparsity of a trained SAE")
    ap.add_argument("--steps", type=int, default=1500, help="SAE training steps")
    ap.add_argument("--arch", choices=["topk", "standard"], default="topk",
                    help="sae-lens architecture of a trained SAE (the tiny model trains a TopK SimpleSAE)")
    ap.add_argument("--batch-size", type=int, default=None,
                    help="activations per SAE training step (default: 512; 256 for the tiny model)")
    ap.add_argument("--lr", type=float, default=None,
                    help="SAE learning rate (default: 4e-4; 3e-3 for the tiny model)")


def _scan_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--latents", type=int, default=96, help="latents scored (a seeded random subset)")
    ap.add_argument("--mode", default="reconstruction,error-preserving",
                    help="comma-separated ablation modes: reconstruction (the reference's: the activation is "
                         "replaced by the SAE reconstruction without the latent), error-preserving (only the latent's "
                         "contribution is removed)")
    ap.add_argument("--candidates", type=int, default=16,
                    help="top-activating contexts kept per latent before de-duplication")
    ap.add_argument("--examples", type=int, default=6, help="examples per latent after de-duplication")
    ap.add_argument("--kl-cutoff", type=float, default=0.05,
                    help="latents whose mean total KL over the horizon is at or below this are excluded")


def _say(msg: str) -> None:
    print(f"ntpflow qscan: {msg}", file=sys.stderr, flush=True)


def _check(args: argparse.Namespace) -> None:
    """Raise a one-line ValueError / FileNotFoundError on bad options, before anything is written."""
    given = vars(args)
    for flag in ("latents", "docs", "d_sae", "k", "steps", "candidates", "examples", "windows", "batch_size"):
        if given.get(flag) is not None and given[flag] < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {given[flag]}")
    if "k" in given and args.k > args.d_sae:
        raise ValueError(f"--k {args.k} exceeds --d-sae {args.d_sae}")
    if "ctx_len" in given and args.ctx_len < 12:  # BOS, a position to ablate, and the 10 predictions scored after it
        raise ValueError(f"--ctx-len must be at least 12, got {args.ctx_len}")
    if given.get("lr") is not None and not 0 < args.lr < math.inf:
        raise ValueError(f"--lr must be positive and finite, got {args.lr}")
    if "mode" in given:
        if not _modes(args) or any(m not in MODES for m in _modes(args)):
            raise ValueError(f"--mode must list modes from {MODES}, got {args.mode!r}")
        if not 0 <= args.kl_cutoff < math.inf:
            raise ValueError(f"--kl-cutoff must be finite and >= 0, got {args.kl_cutoff}")
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    resolve_device(args.device)  # an unknown or unavailable device fails here
    if getattr(args, "sae", None) and not Path(args.sae).is_dir():
        raise FileNotFoundError(f"SAE folder {args.sae} does not exist")
    if bool(getattr(args, "sae_release", None)) != bool(getattr(args, "sae_id", None)):
        raise ValueError("--sae-release and --sae-id go together")
    if getattr(args, "domains", None) is not None or getattr(args, "formal", None):
        domains, _ = _domains(args)
        if domains:  # every domain readable (UTF-8) and holding text, before --out is made
            user_documents(domains, 1, args.seed)
    d = LLMDir(args.out)
    if args.step == "scan" and not (d.has_contexts() and d.sae_dir.is_dir()):
        raise FileNotFoundError(f"{args.out} holds no corpus and SAE; run `ntpflow qscan train --out {args.out}` "
                                "first")


def _domains(args: argparse.Namespace) -> tuple[dict[str, str] | None, tuple[str, ...] | None]:
    """``--domains`` as {label: path} and ``--formal`` as labels (None, None without --domains); ValueError /
    FileNotFoundError (one line) on a bad list, a missing path or a formal label that is not a domain."""
    if not getattr(args, "domains", None):
        if getattr(args, "formal", None):
            raise ValueError("--formal names some of --domains; give --domains too")
        return None, None
    out: dict[str, str] = {}
    for part in args.domains.split(","):
        label, colon, path = part.partition(":")
        if not colon or not label or not path:
            raise ValueError(f"--domains takes LABEL:PATH,..., got {part!r}")
        if label in out:
            raise ValueError(f"--domains names {label!r} twice")
        if not Path(path).exists():
            raise FileNotFoundError(f"domain {label!r}: {path} does not exist")
        out[label] = path
    formal = tuple(f for f in (args.formal or "").split(",") if f)
    unknown = [f for f in formal if f not in out]
    if unknown:
        raise ValueError(f"--formal {','.join(unknown)}: not among --domains ({', '.join(out)})")
    return out, formal


def _given_sae(args: argparse.Namespace, device) -> Any:
    """The SAE of ``--sae DIR`` or ``--sae-release/--sae-id`` (SAELens; the hub or its cache), on ``device``."""
    if args.sae:
        return load_sae(args.sae, device)
    try:
        from sae_lens import SAE

        sae = SAE.from_pretrained(release=args.sae_release, sae_id=args.sae_id, device=str(device))
    except ImportError:
        raise
    except Exception as e:  # noqa: BLE001 - offline, unknown release or id: sae-lens and the hub raise many types
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot load SAE {args.sae_release}/{args.sae_id} (needs the hub or its cache; offline, "
                         f"give --sae DIR): {msg}") from None
    return sae[0] if isinstance(sae, tuple) else sae


def _sae_hook(sae: Any) -> str | None:
    """The hook an SAE reads, as its SAELens config names it (``hook_name``, or ``metadata.hook_name``)."""
    cfg = getattr(sae, "cfg", None)
    for obj in (cfg, getattr(cfg, "metadata", None)):
        hook = getattr(obj, "hook_name", None) if obj is not None else None
        if isinstance(hook, str) and hook:
            return hook
    return None


def _site(lm: Any, args: argparse.Namespace, sae: Any = None) -> None:
    """Set the scanned hook (``--hook``, else the SAE's own, else the model's default), checked against the model;
    an SAE must read the model's width there."""
    hook = getattr(args, "hook", None) or (_sae_hook(sae) if sae is not None else None) or lm.default_hook
    lm.adapter.check_hook(hook)
    lm.default_hook = hook
    if sae is not None and int(sae.W_dec.shape[1]) != lm.adapter.d_model:
        raise ValueError(f"the SAE reads width {int(sae.W_dec.shape[1])}, but the model's d_model is "
                         f"{lm.adapter.d_model}: it does not match the model")


def _modes(args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(m for m in args.mode.split(",") if m)


def _sae_spec(args: argparse.Namespace) -> dict:
    kind = "simple" if args.model == "tiny" else args.arch
    batch, lr = SAE_DEFAULTS[kind]
    return {"kind": kind, "d_sae": args.d_sae, "k": args.k, "steps": args.steps,
            "batch_size": args.batch_size or batch, "lr": args.lr or lr}


def run(args: argparse.Namespace) -> dict:
    """The stages that parsed ``args`` ask for (``args.step``: None for all, ``"train"`` or ``"scan"``); returns
    the SAE quality (train) or the statistics written to ``stats.json``."""
    _check(args)
    d = LLMDir(args.out)
    _say(f"loading {args.model}")
    lm = load_model(args.model, resolve_device(args.device), seed=args.seed)
    given = None
    if args.step == "scan":
        given = d.sae(lm.adapter.device)
    elif not (args.step == "train" or args.train_sae):
        given = _given_sae(args, lm.adapter.device)
    _site(lm, args, given)  # before anything is written
    ensure_writable_dir(args.out)
    if args.step == "scan":
        ctx, sae = d.contexts(), given
    else:
        domains, formal = _domains(args)
        ctx = make_contexts(lm, args.docs, args.ctx_len, args.seed, args.stories, args.windows, domains, formal)
        ctx.save(d.contexts_path)
        assert ctx.domain_names is not None  # set by Contexts.__post_init__
        _say(f"corpus: {len(ctx)} windows of {args.ctx_len} tokens ({', '.join(ctx.domain_names)})")
        if args.step == "train" or args.train_sae:
            sae, quality = fit_sae(lm, ctx, _sae_spec(args), args.seed, say=_say)
            save_sae_stage(d, sae, quality)
            if args.step == "train":
                return quality
        else:
            sae = given
    res, stats = scan(lm, sae, ctx, args.latents, QScanConfig(
        n_candidates=args.candidates, n_examples=args.examples, modes=_modes(args), kl_cutoff=args.kl_cutoff),
        args.seed, say=_say)
    save_scan(d, res, stats)
    return stats


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (``[train|scan] OPTIONS``), run the stages, print a one-line summary; returns the exit code (2
    on bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    step = argv[0] if argv and argv[0] in ("train", "scan") else None
    args = _parser(step).parse_args(argv[1:] if step else argv)
    args.step = step
    try:
        out = run(args)
    except (ValueError, FileNotFoundError, ImportError, RuntimeError, TypeError) as e:
        print(f"ntpflow qscan: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    if step == "train":
        q = {part: out[part] for part in ("train", "eval")}
        print(f"{args.out}: SAE explained variance {q['train']['explained_variance']:.3f} (train), "
              f"{q['eval']['explained_variance']:.3f} (held out); L0 {q['train']['l0']:.1f}")
        return 0
    modes = {m: s for m, s in out.items() if m != "seconds"}
    parts = [f"{m}: {s['n_included']}/{s['n_scored']} latents included"
             + (f" (excluded: {s['excluded_because']})" if s["excluded_because"] else "") for m, s in modes.items()]
    hook = next(iter(modes.values()))["hook"]
    print(f"{args.out} (hook {hook}): " + "; ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
