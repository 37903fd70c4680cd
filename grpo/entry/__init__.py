"""The processes' mains, the top layer above the library: `train.py` (the command line: the memory plan alone,
training, or server mode's rollout ranks) and `serve.py` (a rollout rank of --rollout_mode server). Nothing in grpo/
imports them; `train_grpo.py` runs `train.run`."""
