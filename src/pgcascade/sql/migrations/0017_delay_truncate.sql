-- pgcascade schema, migration 17: delayed leaves, and TRUNCATE on two-way masters.
--
-- node.apply_delay   a delayed leaf (docs/replication.md, "Delayed replica"): the apply_delay its
--                    worker runs with, written by the worker from its config, read by status,
--                    --check and wait-sync from any node; null: not delayed
-- table_truncate     a two-way table's last TRUNCATE (docs/two-way.md, "TRUNCATE"): the version
--                    of every row it removed, as row_version holds a deleted row's.  origin null:
--                    truncated here (xid: that transaction); else the master whose TRUNCATE a
--                    peer's apply replayed (origin_tick, origin_time: its tick and commit time)
-- conflict           the kind update/truncate: a row change and a TRUNCATE made concurrently

alter table pgcascade.node add column apply_delay interval;

create table pgcascade.table_truncate (
    table_name   text primary key,
    origin       text,
    origin_tick  int8,
    origin_time  timestamptz,
    xid          xid8 not null
);

alter table pgcascade.conflict drop constraint conflict_conflict_type_check;
alter table pgcascade.conflict add constraint conflict_conflict_type_check check (conflict_type in
    ('insert/insert', 'update/update', 'update/delete', 'delete/delete', 'update/truncate'));
