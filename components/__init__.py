"""The support modules around train.py's lesson (README "Files"): the checks of every input (checks),
state on disk (out_dir: the folder a run owns and the file helpers; checkpoints: save, resume, retention; hf:
the model's config and first weights, Hugging Face import and export with its tokenizer), the run's reports
(metrics), the planner (plan), the host-memory variations of the step (offload), sampling (sample), the tests'
fault injection (faults), and around data.py a run's data from its flags (run_data) and the built-in sample
(sample_corpus). They import model.py and data.py and each other, never train.py (tests/test_layout.py)."""
