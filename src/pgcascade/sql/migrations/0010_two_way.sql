-- pgcascade schema, migration 10: two-way replication (docs/two-way.md).
--
-- A master is the root of its own queue and, for every other master of the set, a subscriber
-- of that master's queue: a node row of the peer's queue with peer_of = this master's queue.
--
-- node.peer_of        on a peer subscription: the queue this master is the root of
-- node.conflict_policy  the subscription's conflict policy (subscriber_table.conflict_policy
--                     overrides it per table)
-- row_version         what the row versions of two-way tables cannot tell by themselves: the
--                     origin, origin tick and origin commit time of rows last written by a
--                     peer's apply (xid = that apply's transaction), and tombstones of deleted
--                     rows (local deletes: origin null, xid = the deleting transaction)
-- peer_seen           per peer subscription, how far that peer had applied each origin's changes
--                     (tick, and that origin's tick snapshot) as of the last batch applied here:
--                     a local version the peer had seen is no conflict
-- conflict            every conflict found at apply, with both row images and the outcome

alter table pgcascade.node add column peer_of text;
alter table pgcascade.node add column conflict_policy text;
alter table pgcascade.subscriber_table add column conflict_policy text;

create table pgcascade.row_version (
    table_name   text not null,
    row_key      jsonb not null,
    origin       text,            -- the master whose change this is; null: this one
    origin_tick  int8,            -- the tick of the origin's queue that carried it
    origin_time  timestamptz,     -- its commit time on the origin
    xid          xid8 not null,   -- the transaction that wrote it here
    deleted      boolean not null,
    primary key (table_name, row_key)
);

create table pgcascade.peer_seen (
    queue_name     text not null,   -- the peer's queue (a peer subscription here)
    origin         text not null,   -- a master's node name
    seen_tick      int8 not null,
    seen_snapshot  pg_snapshot,
    primary key (queue_name, origin)
);

create table pgcascade.conflict (
    conflict_id    bigserial primary key,
    queue_name     text not null,   -- the peer's queue the remote change came through
    table_name     text not null,
    conflict_type  text not null check (conflict_type in
                       ('insert/insert', 'update/update', 'update/delete', 'delete/delete')),
    row_key        jsonb not null,
    local_row      jsonb,
    remote_row     jsonb,
    local_origin   text,
    remote_origin  text not null,
    local_time     timestamptz,
    remote_time    timestamptz,
    policy         text not null,
    winner         text not null check (winner in ('local', 'remote')),
    tick_id        int8 not null,
    logged         timestamptz not null default now()
);
create index conflict_logged on pgcascade.conflict (logged);
