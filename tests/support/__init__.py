"""What the test files share: the multi-rank harness (rank_grid, spawns), the recorders and
tolerances (checks), data, the test models and the train-both loop. Imported as `support.*`:
pytest puts tests/ on sys.path (no tests/__init__.py), and the ranks run_on_ranks starts inherit
it, so the functions they unpickle are found by the same module paths."""
