-- pgcascade schema, migration 6: the Spark pipeline's resumable copy.
--
-- copy_plan   one row per table whose initial copy runs as Spark tasks (a subscriber table in
--             state in-copy): the snapshot its first ranges were copied under, the tick catch-up
--             starts from, and the indexes and constraints dropped for the copy (restored at the end)
-- copy_range  the plan's key ranges; a range is copied and marked done in one subscriber
--             transaction, so a copy that dies continues with the ranges not done
--
-- The worker clears both when it starts a new copy of the table (NULL -> in-copy).

create table pgcascade.copy_plan (
    queue_name     text not null,
    table_name     text not null,
    reg_tick       int8 not null,          -- the copy consumer's first tick
    first_snapshot pg_snapshot not null,   -- provider snapshot of the first attempt
    definitions    jsonb not null,         -- dropped indexes and constraints, to restore
    est_rows       int8,                   -- the provider's estimate, for the ETA
    attempt        int4 not null default 1,  -- 1 + how many times the copy resumed
    started        timestamptz not null default now(),
    attempt_started timestamptz not null default now(),
    finished       timestamptz,
    primary key (queue_name, table_name)
);

create table pgcascade.copy_range (
    queue_name   text not null,
    table_name   text not null,
    range_no     int4 not null,
    lo           text[],                   -- key bounds, lo <= key < hi (NULL: open)
    hi           text[],
    done         boolean not null default false,
    rows         int8,
    bytes        int8,
    seconds      float8,
    done_at      timestamptz,
    attempt      int4,                     -- which copy attempt (1, 2, ...) copied it
    primary key (queue_name, table_name, range_no),
    foreign key (queue_name, table_name) references pgcascade.copy_plan on delete cascade
);
