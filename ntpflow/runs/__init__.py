"""The runs wing: the run folder (``Run``), the data a run trains on, the training loop for one run or a group,
probing, sweeps, thread records and metric sinks."""
