-- pgcascade schema, migration 15: automatic DDL (docs/ddl.md).
--
-- auto_ddl         the queues whose root (a root, or a two-way master) captures its DDL through
--                  the event triggers: a row per queue with auto-ddl on (`pgcascade CONF auto-ddl on`)
-- node.all_tables  a subscriber that added the set's tables with `add-table --all`: it takes the
--                  tables the root adds by DDL too (auto-ddl --add-new-tables)

create table pgcascade.auto_ddl (
    queue_name      text primary key,
    add_new_tables  boolean not null default false,
    since           timestamptz not null default now()
);

alter table pgcascade.node add column all_tables boolean not null default false;
