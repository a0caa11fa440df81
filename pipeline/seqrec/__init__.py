"""DPFormer's task: differentially private next-item prediction with Transformers, Phantom
Clipping and Re-Attention. Steps: config -> data (sequences, synthetic) -> train (models,
reattention, clipping/) -> evaluate (metrics, attention) -> plot, one cell at a time (``cell``); a
sweep's end (``sweep``); the step audit (``audit``); ``task.py`` is what the shared machinery calls."""
