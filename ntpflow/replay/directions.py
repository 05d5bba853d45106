"""Feature directions of one's own, tracked by ``attribute`` beside (or instead of) the task's probed features.

A direction is a vector w [d_model] read at a residual site ⟨k, i⟩ (a probe of one's own, a DAS direction, an SAE
decoder row): it becomes an :class:`~ntpflow.engine.influence.Probe` named by the user. Sources:

* a tensor or array [d_model] (or [1, d_model]);
* a ``.npy`` file holding one vector [d_model] (or [1, d_model]);
* a ``.safetensors`` file and the KEY of a vector in it;
* a ``.pt`` file (``torch.save``) holding a tensor, or a dict of tensors and the KEY of one;
* SAE latents (:func:`sae_directions`): rows of the decoder ``W_dec`` [d_sae, d_in] of an SAE folder in SAELens's
  layout (``cfg.json`` + ``sae_weights.safetensors``), named ``sae_<latent>``.

On the command line: ``--direction NAME=K:I:PATH[:KEY]`` (:func:`parse_direction`; K may be a TransformerLens
residual hook name) and ``--sae PATH --latents 3,17 --sae-site K:I``. Every check (file, key, shape, width, finite
and not all-zero values, site inside the model, distinct names) runs before anything is written; the attribution's spec.json
records each direction's name, site and the SHA-256 of its float32 bytes (:func:`direction_records`), so a resumed
replay checks it tracks the same vectors.
"""

import hashlib
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from ntpflow.engine.influence import Probe
from ntpflow.files import read_json
from ntpflow.llm.sae import CFG_FILE, WEIGHTS_FILE
from ntpflow.model.sites import Site, parse_layer

_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


def parse_direction(text: str) -> tuple[str, Site, str, str | None]:
    """``"NAME=K:I:PATH[:KEY]"`` → (name, Site(K, I), path, key or None); KEY only after a ``.safetensors`` or
    ``.pt`` path."""
    name, eq, rest = text.partition("=")
    parts = rest.split(":")
    if not eq or len(parts) < 3 or not name:
        raise ValueError(f"cannot parse direction {text!r}; expected NAME=LAYER:POS:PATH[.npy] or "
                         "NAME=LAYER:POS:PATH.safetensors:KEY (or PATH.pt[:KEY])")
    try:
        site = Site(parse_layer(parts[0]), int(parts[1]))
    except ValueError as e:
        raise ValueError(f"cannot parse the site of direction {text!r} ({e})") from None
    path, key = ":".join(parts[2:]), None
    head, colon, tail = path.rpartition(":")
    if colon and head.endswith((".safetensors", ".pt")):
        path, key = head, tail
    return name, site, path, key


def read_vector(source, key: str | None = None) -> torch.Tensor:
    """The vector [d] of ``source``: a tensor or array, a ``.npy`` file, a ``.safetensors`` file with ``key``, or a
    ``.pt`` file holding a tensor or a dict with ``key`` (``source`` may also be a (path, key) pair); shaped [d] or
    [1, d]; float32 on the CPU. ValueError / FileNotFoundError (one line) on a missing file or key, another suffix,
    or a value that is not one vector."""
    if isinstance(source, tuple):
        source, key = source
    if isinstance(source, torch.Tensor | np.ndarray):
        v, what = torch.as_tensor(source), "the given direction"
    else:
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"direction file {path} does not exist")
        if path.suffix == ".npy":
            if key is not None:
                raise ValueError(f"{path}: a .npy file holds one array; no KEY after it")
            try:
                v = torch.from_numpy(np.load(path, allow_pickle=False))
            except (ValueError, TypeError, OSError, EOFError) as e:  # truncated, pickled, strings, ...
                raise ValueError(f"cannot read {path} as a numeric .npy array ({e})") from None
        elif path.suffix == ".safetensors":
            from safetensors import safe_open

            if key is None:
                raise ValueError(f"{path}: name the vector in it, PATH.safetensors:KEY")
            try:
                with safe_open(str(path), framework="pt") as f:
                    if key not in f.keys():
                        raise ValueError(f"{path} has no key {key!r} (keys: {', '.join(sorted(f.keys())[:8])})")
                    v = f.get_tensor(key)
            except ValueError:
                raise
            except Exception as e:  # safetensors' own error types: a truncated or foreign file
                raise ValueError(f"cannot read {path} as a .safetensors file ({type(e).__name__}: {e})") from None
        elif path.suffix == ".pt":
            v = _read_pt(path, key)
        else:
            raise ValueError(f"direction file {path}: expected .npy, .safetensors or .pt")
        what = f"{path}" + (f":{key}" if key else "")
    if v.dim() == 2 and v.shape[0] == 1:
        v = v[0]  # [1, d], as a probe's or SAE's weight row often is
    if v.dim() != 1 or not (v.dtype.is_floating_point or v.dtype in (torch.int32, torch.int64)):
        raise ValueError(f"{what} must be one vector [d_model] of numbers, got {v.dtype} {tuple(v.shape)}")
    return v.detach().to("cpu", torch.float32).contiguous()


def _read_pt(path: Path, key: str | None) -> torch.Tensor:
    """The tensor in a ``torch.save`` file ``path``: the file's tensor, or its dict's entry ``key`` (weights only: no
    code is run)."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle, zip and torch errors
        raise ValueError(f"cannot read {path} as a torch.save file of tensors ({str(e).splitlines()[0]})") from None
    if isinstance(obj, torch.Tensor):
        if key is not None:
            raise ValueError(f"{path} holds one tensor; no KEY after it")
        return obj
    if not isinstance(obj, dict):
        raise ValueError(f"{path} holds a {type(obj).__name__}; expected a tensor or a dict of tensors")
    keys = ", ".join(sorted(map(str, obj))[:8])
    if key is None:
        raise ValueError(f"{path} holds a dict: name the vector in it, PATH.pt:KEY (keys: {keys})")
    if key not in obj or not isinstance(obj[key], torch.Tensor):
        raise ValueError(f"{path} has no tensor under key {key!r} (keys: {keys})")
    return obj[key]


def sae_directions(path: str | Path, latents: Sequence[int], site: Site) -> dict[str, tuple[Site, torch.Tensor]]:
    """Decoder rows ``W_dec[latent]`` [d_in] of the SAE in folder ``path`` (SAELens's layout: ``cfg.json`` +
    ``sae_weights.safetensors`` with ``W_dec`` [d_sae, d_in]; read as stored, without SAELens), as directions
    ``{"sae_<latent>": (site, row)}``. If cfg.json names a residual hook (``hook_name``), it must be ``site``'s layer.
    """
    from safetensors import safe_open

    path = Path(path)
    if not (path / CFG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"no SAE in {path} (expected {CFG_FILE} and {WEIGHTS_FILE})")
    cfg = read_json(path / CFG_FILE)
    hook = cfg.get("hook_name") or (cfg.get("metadata") or {}).get("hook_name")
    if isinstance(hook, str):
        try:
            layer = parse_layer(hook)
        except ValueError:
            layer = None  # not a residual hook: nothing to compare
        if layer is not None and layer != site.layer:
            raise ValueError(f"the SAE in {path} reads {hook} (layer {layer}), not the site's layer {site.layer}")
    try:
        with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
            if "W_dec" not in f.keys():
                raise ValueError(f"{path / WEIGHTS_FILE} has no W_dec")
            w = f.get_tensor("W_dec")
    except ValueError:
        raise
    except Exception as e:  # safetensors' own error types: a truncated or foreign file
        raise ValueError(f"cannot read {path / WEIGHTS_FILE} as a .safetensors file ({type(e).__name__}: {e})") from None
    if w.dim() != 2:
        raise ValueError(f"{path / WEIGHTS_FILE}: W_dec must be [d_sae, d_in], got {tuple(w.shape)}")
    bad = [i for i in latents if not 0 <= i < w.shape[0]]
    if bad or not latents:
        raise ValueError(f"latents {bad or list(latents)} out of range: the SAE in {path} has {w.shape[0]}")
    return {f"sae_{i}": (site, w[i].float()) for i in latents}


def direction_probes(directions: Mapping[str, tuple], n_layer: int, n_pos: int, d_model: int,
                     taken: Sequence[str] = ()) -> list[Probe]:
    """Check ``directions`` ({name: (Site, source)}, source as :func:`read_vector` takes it) against a model with
    ``n_layer`` blocks, ``n_pos`` positions and width ``d_model``, and the task's feature names ``taken``; returns
    their Probes in the given order. Raises ValueError (one line) before anything is written."""
    probes = []
    for name, spec in directions.items():
        if not _NAME.match(name):
            raise ValueError(f"direction name {name!r}: use letters, digits, _ . - only")
        if name in taken:
            raise ValueError(f"direction name {name!r} is a feature of the task; choose another")
        try:
            site, source = spec
        except (TypeError, ValueError):
            raise ValueError(f"direction {name!r}: give (Site, tensor or path)") from None
        if not isinstance(site, Site):
            raise ValueError(f"direction {name!r}: its site must be a Site, got {site!r}")
        try:
            site.check(n_layer, n_pos)
        except ValueError as e:
            raise ValueError(f"direction {name!r}: {e}") from None
        w = read_vector(source)
        if w.shape != (d_model,):
            raise ValueError(f"direction {name!r} has width {w.shape[0]}; the model's d_model is {d_model}")
        if not torch.isfinite(w).all():
            raise ValueError(f"direction {name!r} has non-finite values (NaN or inf)")
        if not w.any():
            raise ValueError(f"direction {name!r} is all zeros: it reads no feature")
        probes.append(Probe(site, name, w))
    return probes


def direction_records(probes: Sequence[Probe]) -> list[dict]:
    """What spec.json records of each direction: name, site [layer, pos], and the SHA-256 of its float32 bytes."""
    return [{"name": p.name, "site": [p.site.layer, p.site.pos],
             "sha256": hashlib.sha256(p.w.to("cpu", torch.float32).contiguous().numpy().tobytes()).hexdigest()}
            for p in probes]
