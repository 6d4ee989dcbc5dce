-- pgcascade schema, migration 2: the retry queue.
--
-- event_retry() parks an event here until its time comes; the ticker's maintenance
-- (maint_retry_events) then puts it back into the queue, owned by the consumer that asked,
-- so only that consumer sees it again.

create table pgcascade.retry_queue (
    ev_retry_after  timestamptz not null,
    ev_queue        int4        not null references pgcascade.queue on delete cascade,
    ev_owner        int4        not null references pgcascade.subscription on delete cascade,
    ev_id           int8        not null,
    ev_time         timestamptz not null,
    ev_retry        int4        not null,
    ev_type         text,
    ev_data         text,
    ev_extra1       text,
    ev_extra2       text,
    ev_extra3       text,
    ev_extra4       text,
    primary key (ev_owner, ev_id)
);
create index retry_queue_due_idx on pgcascade.retry_queue (ev_retry_after);
