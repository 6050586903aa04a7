"""Run-folder workflows, one module per task (collect, sweep, calibrate, evaluate, profile, cut, quantize, export,
ensemble, the torchensemble baselines, seeds, CAM, ponder maps, compare, report, the promise check, the demo): each
takes a run folder and returns a result. The commands layer (:mod:`anytime.commands`) parses and prints around them."""
