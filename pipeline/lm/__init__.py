"""DP language modelling on 20 Newsgroups (issue 38): tied against untied Transformers under
DP-SGD with exact per-post clipping. Built so far: the posts (``data.py``) and the private
vocabulary (``vocab.py``); the task is not registered in ``pipeline/tasks.py`` yet."""
