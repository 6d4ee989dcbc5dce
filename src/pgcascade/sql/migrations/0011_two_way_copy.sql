-- pgcascade schema, migration 11: the first copy of a two-way table into a master (docs/two-way.md).
--
-- peer_copy   per table copied here from a peer: the copy's transaction and that peer.  The rows
--             the copy wrote (their xmin is that transaction) count as that peer's, as old as
--             can be and seen by every master: one row per copy, not a row_version per row.

create table pgcascade.peer_copy (
    table_name   text primary key,
    xid          xid8 not null,
    origin       text not null
);
