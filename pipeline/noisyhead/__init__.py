"""NoisyHead's task: a linear attention head for in-context learning, pretrained with noisy,
clipped, projected gradient descent ("How Private is Your Attention?"), against ridge and the other
estimators of ``methods/``. Steps: config -> data (features, attacks, newsgroups) -> train
(methods) -> evaluate -> plot, one cell at a time (``cell``); a sweep's end (``sweep``); the
empirical audit (``audit``); ``task.py`` is what the shared machinery calls."""
