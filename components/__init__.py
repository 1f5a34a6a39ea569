"""The support modules around train.py's lesson (README "Files"): the checks of every input (checks),
state on disk (disk), the run's reports (metrics), the host-memory variations of the
step (offload), sampling (sample), the tests' fault injection (faults), and around data.py a run's data
from its flags (run_data), the built-in sample (sample_corpus) and an export's tokenizer (tokenizer_export).
They import model.py and data.py and each other, never train.py nor tools/ (the planner, the plot: tools
above the trainer, which import it) (tests/test_layout.py)."""
