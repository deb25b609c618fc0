"""Checkpoints: ``store`` (one on disk, verified and restored; the store that lists, saves,
prunes and sets aside), ``state`` (what a checkpoint holds besides weights), ``restore`` (a
run's directory, the checkpoint or a user's ``BackupAndRestore`` put back and broadcast) and
``resume_check`` (a resume never mixes runs; the update batch it continues at)."""
