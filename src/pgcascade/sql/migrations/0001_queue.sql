-- pgcascade schema, migration 1: the transactional queue (PgQ semantics).
--
-- Events of every queue live in one partitioned table, pgcascade.event, with a partition per
-- (queue, rotation slot): ev_part = queue_id * 16 + slot.  Insert and read use static SQL
-- against the parent, so PL/pgSQL caches their plans; rotation TRUNCATEs a partition.
--
-- The event row is kept to 8 columns so that its null bitmap fits inside the 24-byte tuple
-- header; fields that few events use (extra2..4, retry count, owner) share one nullable
-- composite, ev_rare.
--
-- ev_txid is int8 from txid_current(), as in PgQ: consumers get it as int8, and reading a
-- batch then converts nothing per row (an xid8 column needs xid8 -> text -> int8 on each).
-- Its visibility is tested with txid_visible_in_snapshot() against the ticks' pg_snapshot,
-- which has the same representation as txid_snapshot.

create table pgcascade.queue (
    queue_id                  int4        primary key,
    queue_name                text        not null unique,
    queue_ntables             int4        not null default 3 check (queue_ntables between 2 and 16),
    queue_cur_table           int4        not null default 0,
    queue_rotation_period     interval    not null default '2 hours',
    queue_switch_time         timestamptz not null default now(),
    queue_event_seq           regclass    not null,
    queue_ticker_max_count    int4        not null default 500,
    queue_ticker_max_lag      interval    not null default '50 milliseconds',
    queue_ticker_idle_period  interval    not null default '1 second',
    queue_ticker_paused       boolean     not null default false,
    -- ticks come from outside (a cascade branch repeats its provider's tick ids)
    queue_external_ticker     boolean     not null default false,
    queue_disable_insert      boolean     not null default false,
    queue_created             timestamptz not null default now()
);
create sequence pgcascade.queue_id_seq owned by pgcascade.queue.queue_id;

-- A tick is a snapshot: a batch is the events visible in one tick's snapshot and not the previous one's.
create table pgcascade.tick (
    tick_queue      int4        not null references pgcascade.queue on delete cascade,
    tick_id         int8        not null,
    tick_time       timestamptz not null default now(),
    tick_snapshot   pg_snapshot not null,
    tick_event_seq  int8        not null,   -- last ev_id handed out when the tick was taken
    primary key (tick_queue, tick_id)
);

create table pgcascade.consumer (
    co_id    serial primary key,
    co_name  text   not null unique
);

create table pgcascade.subscription (
    sub_id         serial primary key,
    sub_queue      int4        not null references pgcascade.queue on delete cascade,
    sub_consumer   int4        not null references pgcascade.consumer,
    sub_last_tick  int8        not null,   -- last tick whose batch was finished
    sub_batch      int8        unique,     -- the open batch, if any
    sub_next_tick  int8,                   -- the tick that closes the open batch
    sub_active     timestamptz not null default now(),
    unique (sub_queue, sub_consumer)
);

create sequence pgcascade.batch_id_seq;

create type pgcascade.event_rare as (
    ev_extra2  text,
    ev_extra3  text,
    ev_extra4  text,
    ev_retry   int4,
    ev_owner   int4     -- sub_id: a retried event is delivered to its own consumer only
);

create table pgcascade.event (
    ev_id      int8        not null,
    ev_time    timestamptz not null,
    ev_txid    int8        not null default txid_current(),
    ev_part    int4        not null,
    ev_type    text,
    ev_data    text,
    ev_extra1  text,
    ev_rare    pgcascade.event_rare
) partition by list (ev_part);
create index event_txid_idx on pgcascade.event (ev_txid);
