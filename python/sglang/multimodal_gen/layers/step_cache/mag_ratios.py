"""MagCache's calibrated magnitude ratios: the file beside a model, its lookup and interpolation.

MagCache (Ma et al., "MagCache: Fast Video Generation with Magnitude-Aware Cache", 2025) skips
steps from a per-model curve of ratios ``mag_ratios[t] = ||r_t|| / ||r_{t-1}||`` of the block
sequence's residual ``r`` (output - input of the main stream) between consecutive steps,
measured once per model by a calibration run (``sglang calibrate-cache``, or a request with
``cache={"method": "magcache", "calibrate": true}``, whose step-cache summary carries them).

The file (:data:`RATIOS_FILE` in the model directory, or any path given by
``--cache-mag-ratios``) is JSON::

    {"method": "magcache", "num_inference_steps": 8,
     "ratios": {"blocks/0/cond": [1.0, 1.21, ...], ...}}

A key is ``"<sequence name>/<denoiser>/<branch context>"``: the denoiser is its order of first use
in a request (``0``; a two-expert model's second expert ``1``), the context ``"cond"`` /
``"uncond"`` when CFG branches keep their own states, ``"joint"`` when they share one. A state
takes the list of its own key, else of the same sequence and denoiser under another context, else
the first list (the ratios are model-specific but prompt-independent). Each list has one ratio
per call of its state (``num_inference_steps`` entries for a one-denoiser model).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

__all__ = ["RATIOS_FILE", "MagRatios", "calibration_command", "nearest_interp"]

#: The ratios file's name in a model directory.
RATIOS_FILE = "magcache_ratios.json"


def calibration_command(model_dir: str | None = None) -> str:
    """The command that writes a model's ratios file (named by start-up errors)."""
    return "sglang calibrate-cache" + (f" --model-path {model_dir}" if model_dir else "")


def _json_kind(value) -> str:
    """The JSON name of ``value``'s type (for messages)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, dict):
        return "empty object" if not value else "object"
    if isinstance(value, list):
        return "empty list" if not value else "list"
    return "string" if isinstance(value, str) else "number"


def nearest_interp(ratios: list[float], length: int) -> list[float]:
    """``ratios`` resampled to ``length`` entries by the nearest source index (diffusers'
    ``hooks.mag_cache.nearest_interp``): entry ``i`` is ``ratios[round(i * (n - 1) /
    (length - 1))]`` (round half to even, as ``torch.round``); ``length == 1``: the last ratio.

    Raises:
        ValueError: ``ratios`` is empty or ``length < 1``.
    """
    if not ratios or length < 1:
        raise ValueError(f"nearest_interp: {len(ratios)} ratios to {length} entries")
    if length == 1:
        return [ratios[-1]]
    scale = (len(ratios) - 1) / (length - 1)
    # float32 grid and scale as diffusers computes them (a tie rounds the same way)
    import torch

    idx = torch.round(torch.arange(length, dtype=torch.float32) * scale).long().tolist()
    return [ratios[i] for i in idx]


@dataclass(frozen=True)
class MagRatios:
    """A model's calibrated ratios (see the module docstring).

    Attributes:
        num_inference_steps: the steps of the calibration run.
        ratios: key -> one ratio per call of that state (finite, > 0).
        source: where they were read from (for messages).
    """

    num_inference_steps: int
    ratios: dict[str, tuple[float, ...]]
    source: str = ""

    def for_state(self, key: str, steps: int | None) -> list[float]:
        """The ratios of state ``key`` for a request of ``steps`` inference steps: the key's list
        (or its fallback), resampled by :func:`nearest_interp` to ``round(n * steps /
        num_inference_steps)`` entries for a list of ``n`` (``steps`` itself when the list covers
        every step, as diffusers interpolates to ``num_inference_steps``); as is when ``steps``
        is ``None``."""
        seq_den = key.rsplit("/", 1)[0] + "/"
        chosen = self.ratios.get(key)
        if chosen is None:
            chosen = next(
                (v for k, v in self.ratios.items() if k.startswith(seq_den)),
                next(iter(self.ratios.values())),
            )
        if steps is None or len(chosen) == 0:
            return list(chosen)
        length = max(1, round(len(chosen) * steps / self.num_inference_steps))
        return list(chosen) if length == len(chosen) else nearest_interp(list(chosen), length)

    @classmethod
    def average(cls, runs: list[dict[str, list[float]]], steps: int) -> MagRatios:
        """The ratios of several calibration runs of ``steps`` steps (each a request's
        ``"mag_ratios"`` summary entry), averaged per key and call over the runs that measured
        that call (the paper averages a few prompts).

        Raises:
            ValueError: no run measured any ratio.
        """
        sums: dict[str, list[list[float]]] = {}
        for run in runs:
            for key, values in run.items():
                cols = sums.setdefault(key, [])
                for i, v in enumerate(values):
                    if i == len(cols):
                        cols.append([])
                    cols[i].append(float(v))
        if not sums:
            raise ValueError("calibration: no ratio was measured (does the model cache steps?)")
        ratios = {k: tuple(sum(c) / len(c) for c in cols) for k, cols in sums.items()}
        return cls(steps, ratios)

    def to_json(self) -> dict:
        return {
            "method": "magcache",
            "num_inference_steps": self.num_inference_steps,
            "ratios": {k: list(v) for k, v in self.ratios.items()},
        }

    def save(self, path: str) -> None:
        """Write the file (atomically: a temporary sibling renamed into place)."""
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=1)
            f.write("\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> MagRatios:
        """Read a ratios file.

        Raises:
            ValueError: not a ratios file, each field checked by kind: unreadable JSON, JSON
                that is not an object, a missing field, ``method`` that is not ``"magcache"``,
                ``num_inference_steps`` that is not an integer >= 1 (a bool is refused),
                ``ratios`` that is not a non-empty object of non-empty lists, a ratio that is not
                a finite number > 0 (a bool is refused); the message names the path and the
                field.
        """
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: not a MagCache ratios file ({e})") from None

        def bad(detail: str) -> ValueError:
            return ValueError(f"{path}: not a MagCache ratios file ({detail})")

        if not isinstance(data, dict):
            raise bad(f"the file holds a JSON {_json_kind(data)}, not an object")
        for name in ("num_inference_steps", "ratios"):
            if name not in data:
                raise bad(f"missing field '{name}'")
        if "method" in data and data["method"] != "magcache":
            raise bad(f'method must be "magcache", got {data["method"]!r}')
        steps = data["num_inference_steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise bad(f"num_inference_steps must be an integer >= 1, got {json.dumps(steps)}")
        raw = data["ratios"]
        if not isinstance(raw, dict) or not raw:
            raise bad(f"ratios must be a non-empty object of lists, got {_json_kind(raw)}")
        ratios = {}
        for k, v in raw.items():
            if not isinstance(v, list) or not v:
                raise bad(f"ratios[{k!r}] must be a non-empty list, got {_json_kind(v)}")
            for x in v:
                if isinstance(x, bool) or not isinstance(x, (int, float)):
                    raise bad(f"ratios[{k!r}] holds {json.dumps(x)}, not a number")
                if not math.isfinite(x) or x <= 0:
                    raise bad(f"ratios[{k!r}] holds {x!r}, not a finite ratio > 0")
            ratios[str(k)] = tuple(float(x) for x in v)
        return cls(steps, ratios, path)

    @classmethod
    def find(cls, model_dir: str | None, path: str | None = None) -> MagRatios | None:
        """The ratios of ``path`` (``--cache-mag-ratios``), else of :data:`RATIOS_FILE` in
        ``model_dir`` when it exists; ``None`` when neither is there.

        Raises:
            ValueError: ``path`` does not exist (naming ``--cache-mag-ratios``), or a file is
                not a ratios file.
        """
        if path is not None:
            if not os.path.isfile(path):
                raise ValueError(f"--cache-mag-ratios {path}: no such file")
            return cls.load(path)
        if model_dir is not None:
            beside = os.path.join(model_dir, RATIOS_FILE)
            if os.path.isfile(beside):
                return cls.load(beside)
        return None
