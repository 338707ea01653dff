"""`specdecode distill`: record the target's features on text, then train a draft head on them
(recipe.py: the options and their defaults; data.py: the features; train.py: the training; command.py:
the pipeline)."""
