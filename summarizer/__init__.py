"""The machinery that train.py, evaluate.py, predict.py and export.py share."""
