"""A submitted run from the trainer's side: the `Batch` handle submit returns (`batch`), its
progress while it runs (`progress`), taking whole groups and cancelling the surplus (`take`), and
cancelling its jobs (`cancel`)."""
