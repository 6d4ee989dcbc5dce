-- Every install regenerates the capture functions of every queue, so that an upgrade leaves
-- functions of this release (they are generated code, which no file here replaces).
select pgcascade.capture_refresh(queue_name) from pgcascade.queue;
