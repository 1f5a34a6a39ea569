"""The support modules around train.py's lesson (README "Files"): the flags and their checks, with the tests'
fault hook (flags), the run's checks before any work (checks), state on disk (out_dir: the folder a run owns and
the file helpers; checkpoints: save, resume, retention; hf: the model's config and first weights, Hugging Face
import and export with its tokenizer), the run's reports (metrics), the host-memory variations of the step
(offload), sampling (sample), and around data.py a run's data from its flags (run_data, which runs
tools/sample_corpus.py for the built-in sample). They import model.py and data.py and each other, never train.py
nor tools/ (the planner, the plot, data preparation: tools above the trainer, which import it)
(tests/test_layout.py)."""
