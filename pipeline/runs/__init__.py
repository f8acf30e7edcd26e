"""A submitted run from the trainer's side: the `Batch` handle submit returns (`batch`), its
progress while it runs (`progress`), and cancelling its jobs (`cancel`)."""
