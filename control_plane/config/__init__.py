"""The limit configuration's versioned log: the writers' lock, the version, the change
log engines are pushed, the snapshot, and the follower that keeps a limit model at the
log's newest version."""
