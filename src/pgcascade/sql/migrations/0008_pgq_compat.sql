-- pgcascade schema, migration 8: what the pgq compatibility schema (install --pgq-compat) needs.
--
-- queue_per_tx_limit  PgQ's cap on the events one transaction may insert into the queue
--                     (pgq.insert_event refuses the one past it); null: no cap
-- queue_extra_maint   functions PgQ's maint_operations() lists for the queue (pgqd calls
--                     them with the queue name)
-- retry_queue.ev_retry may be null: pgq.event_retry_raw() stores the count its caller gives.

alter table pgcascade.queue
    add column queue_per_tx_limit int4,
    add column queue_extra_maint  text[];

alter table pgcascade.retry_queue alter column ev_retry drop not null;
