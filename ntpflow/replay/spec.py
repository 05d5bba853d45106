"""What an attribution computes: ``AttributionSpec``, the one settings object of ``attribute`` and ``attribute_group``.

    spec = AttributionSpec(parse_sites("1:4,1:14"), ["is_majority_0"])   # the exact account, both readings
    spec = AttributionSpec(parse_sites("1:4"), reading="paper")           # the paper's batch reading
    spec = AttributionSpec(directions={"mine": ("1:4", w)}, matrices=True)  # a direction of one's own

Where the output goes and how the work runs (folder, device, progress, lock) are the functions' own arguments.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

from ntpflow.model.sites import Site
from ntpflow.runs.account import default_readout

READINGS = ("exact", "paper", "midpoint")


@dataclass(frozen=True, eq=False)
class AttributionSpec:
    """The settings of an attribution (docs/balance.md):

    sites: residual sites (``ntpflow.parse_sites("1-2:2-19")``: layers × positions); features: the task's
    features probed there (None: all); directions: {name: (site, w as tensor, array or path)}, directions of one's
    own tracked beside (or, with no sites, instead of) the task's (``ntpflow.replay.directions``); reading:
    ``"exact"`` (the exact account on a readout set), ``"paper"`` (R on each step's batch, ∇R at θ_t) or
    ``"midpoint"`` (the same, ∇R at the step's midpoint); readout: the exact account's readout set, the first N
    evaluation sequences (None: :func:`readout_size`'s default); sgd_rows: also the SGD direction's rows (the second
    reading); matrices: also every site's influence matrices (exact reading only); replay: replay a run trained
    with the account all the same; block: steps between a replay's saved states (None: the run's ``ckpt_every``).
    ValueError (one line) for a combination that cannot be computed."""

    sites: Sequence[Site] = ()
    features: Sequence[str] | None = None
    directions: Mapping[str, tuple] = field(default_factory=dict)
    reading: str = "exact"
    readout: int | None = None
    sgd_rows: bool = True
    matrices: bool = False
    replay: bool = False
    block: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "sites", tuple(self.sites))
        if self.features is not None:
            object.__setattr__(self, "features", tuple(self.features))
        object.__setattr__(self, "directions", dict(self.directions))
        if self.reading not in READINGS:
            raise ValueError(f"unknown reading {self.reading!r}; choose one of {', '.join(READINGS)}")
        if self.reading != "exact" and self.readout is not None:
            raise ValueError(f"--readout sets the exact account's readout set; it does not combine with "
                             f"--{self.reading}")
        if self.reading != "exact" and self.matrices:
            raise ValueError("--matrices needs the exact account (not --paper or --midpoint)")
        if self.block is not None and self.block < 1:
            raise ValueError(f"block takes a positive number of steps, got {self.block}")

    def check_group(self) -> None:
        """ValueError (one line) if this spec cannot attribute several runs (a run group) at once."""
        if self.directions or self.matrices:
            raise ValueError("--direction, --sae and --matrices attribute a single run (not --group or several "
                             "run dirs)")

    def readout_size(self, n_eval: int, batch_size: int) -> int | None:
        """The readout set's size on a run with ``n_eval`` evaluation sequences and this batch size: None for the
        batch readings; else ``readout`` (ValueError outside 2..n_eval) or the default, the run's batch (at most
        DEFAULT_READOUT and n_eval, at least 2). The exact account's cost grows with readout / batch (BENCHMARKS.md),
        so the default stays near its cost at readout = batch; a larger readout makes R_H a closer estimate of the
        mismatch over the data, not the split more exact (docs/balance.md)."""
        if self.reading != "exact":
            return None
        if self.readout is None:
            return default_readout(n_eval, batch_size)
        if not 2 <= self.readout <= n_eval:
            raise ValueError(f"--readout takes 2..{n_eval} (the run's evaluation sequences), got {self.readout}")
        return self.readout

    @classmethod
    def of(cls, spec: "AttributionSpec | Sequence[Site]" = (), features: Sequence[str] | None = None,
           **settings) -> "AttributionSpec":
        """``spec`` itself, or one made of sites, features and ``settings`` (the fields by name); ValueError when
        a spec is given with more settings."""
        if isinstance(spec, AttributionSpec):
            if features is not None or settings:
                raise ValueError("give an AttributionSpec or its settings, not both")
            return spec
        unknown = set(settings) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"AttributionSpec has no setting {', '.join(sorted(unknown))}")
        return cls(spec, features, **settings)
