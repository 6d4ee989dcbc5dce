-- pgcascade schema, migration 4: the cascade.
--
-- node_watermark  on a node with a queue: the lowest tick each direct subscriber, and every
--                 node below it, still needs.  Subscribers report it after their batches; a
--                 node's own watermark is the lowest of its own position and these.  The
--                 root publishes the lowest of all as the global watermark, an event every
--                 node with a queue keeps as the registration '.global_watermark', so no node
--                 deletes ticks or events that a node anywhere in the set may still ask for.

create table pgcascade.node_watermark (
    queue_name  text not null,
    node_name   text not null,
    watermark   int8 not null,
    reported    timestamptz not null default now(),
    primary key (queue_name, node_name)
);

-- the last tick of the old root's history a node carried when it became the root: what a
-- resurrected old root had after it never reached the set
alter table pgcascade.node add column root_since_tick int8;

-- a merge-leaf: a leaf of a partition's queue whose worker also writes the partition's changes
-- into this database's combined queue (seed 003's combined partitions)
alter table pgcascade.node add column combined_queue text;
