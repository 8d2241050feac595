"""Tests of streamrl.learner.model."""
