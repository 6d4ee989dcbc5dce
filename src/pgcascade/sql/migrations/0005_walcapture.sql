-- pgcascade schema, migration 5: logical (WAL-based) capture on the root.
--
-- A root whose queue has a row here captures through a publication and a pgoutput slot
-- instead of triggers; the capture daemon (walcapture.py) reads the slot and inserts the
-- events.  confirmed_lsn is the exactly-once record: the end of the last source transaction
-- whose events are in the queue, written in the same transaction as those events.  The slot
-- is advanced only after that commit, so after any crash the daemon skips what the slot
-- hands out again below this position.

create table pgcascade.walcapture (
    queue_name     text primary key,
    slot_name      text not null unique,
    publication    text not null,
    confirmed_lsn  pg_lsn not null default '0/0',
    last_commit    timestamptz,     -- commit time of the last source transaction captured
    last_capture   timestamptz,     -- when the daemon last wrote its position
    last_error     text,            -- the daemon's last failure, cleared by its next capture
    last_error_time timestamptz,
    created        timestamptz not null default now()
);
