"""Tests of streamrl.learner.hf."""
