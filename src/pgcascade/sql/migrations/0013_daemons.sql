-- pgcascade schema, migration 13: one daemon per node and role, its heartbeat; the way back to
-- Londiste after import-londiste (back-to-londiste).
--
-- daemon            one row per daemon that ran here (core/daemonlock.py writes it): a worker or
--                   capture daemon per queue, a ticker per database (queue_name '').  The daemon
--                   holds a session advisory lock for its whole life; this row says who it is
--                   (host, pid, job, config), since when, and when it last looped (heartbeat,
--                   at most once a second).  A row whose lock nobody holds is a daemon that
--                   stopped: `stopped` is set when it exited by itself, null when it was killed.
create table pgcascade.daemon (
    role         text not null,
    queue_name   text not null,
    job_name     text not null,
    host         text not null,
    pid          int4 not null,
    config       text,
    backend_pid  int4 not null,
    started      timestamptz not null,
    heartbeat    timestamptz not null,
    stopped      timestamptz,
    primary key (role, queue_name)
);

-- londiste_trigger  Londiste's triggers as import-londiste found them on this node's tables
--                   (pg_get_triggerdef with every name qualified, and pg_trigger.tgenabled),
--                   before it dropped them: back-to-londiste puts back exactly these.
create table pgcascade.londiste_trigger (
    queue_name    text not null,
    table_name    text not null,
    trigger_name  text not null,
    definition    text not null,
    enabled       text not null,
    primary key (queue_name, table_name, trigger_name)
);

-- londiste_import.pgcascade_final_tick: set by back-to-londiste on the root, the pgcascade tick
-- after which Londiste's triggers capture again; a subscriber goes back to Londiste once its
-- pgcascade worker has applied it.
alter table pgcascade.londiste_import add column pgcascade_final_tick int8;
