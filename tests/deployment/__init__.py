"""Tests of deployment/."""
