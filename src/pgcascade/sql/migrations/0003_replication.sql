-- pgcascade schema, migration 3: nodes and table replication.
--
-- node            this database's membership in a set (one row per set/queue it belongs to)
-- node_location   node name -> connection string: the only data every node duplicates
-- set_table       tables the set replicates; on the root, the ones it captures
-- set_seq         sequences the set replicates
-- subscriber_table  tables this node replicates from its provider, with the copy state
-- subscriber_seq    sequences this node follows

create table pgcascade.node (
    queue_name       text primary key,
    node_name        text not null,
    node_type        text not null check (node_type in ('root', 'branch', 'leaf')),
    provider_node    text,
    worker_name      text,          -- this node's consumer on its provider's queue
    last_tick        int8,          -- last tick applied here (the exactly-once record)
    paused           boolean not null default false,
    last_error       text,
    last_error_time  timestamptz,
    created          timestamptz not null default now()
);

create table pgcascade.node_location (
    queue_name     text not null,
    node_name      text not null,
    node_location  text not null,
    dead           boolean not null default false,
    primary key (queue_name, node_name)
);

create table pgcascade.set_table (
    queue_name    text not null,
    table_name    text not null,   -- schema-qualified, quoted as needed: format('%I.%I')
    key_columns   text[] not null,
    event_format  text not null default 'json' check (event_format in ('json', 'sql')),
    added         timestamptz not null default now(),
    primary key (queue_name, table_name)
);

create table pgcascade.set_seq (
    queue_name  text not null,
    seq_name    text not null,
    primary key (queue_name, seq_name)
);

create table pgcascade.subscriber_table (
    queue_name     text not null,
    table_name     text not null,   -- the provider's name, as in the events
    dest_table     text not null,   -- the local table it is applied to
    key_columns    text[] not null,
    state          text,            -- NULL, in-copy, catching-up, wanna-sync:T, do-sync:T, ok
    copy_snapshot  pg_snapshot,     -- provider snapshot the copy was taken in
    copy_tick      int8,            -- last tick the copy process applied while catching up
    copy_pid       int4,
    skip_truncate  boolean not null default false,
    local_writes   boolean not null default false,
    added          timestamptz not null default now(),
    primary key (queue_name, table_name)
);

create table pgcascade.subscriber_seq (
    queue_name  text not null,
    seq_name    text not null,
    dest_seq    text not null,
    primary key (queue_name, seq_name)
);
