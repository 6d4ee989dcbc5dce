-- pgcascade schema, migration 19: a doorbell per queue (docs/design.md, "The change path").
--
-- A consumer that makes its queue's ticks on demand sleeps on LISTEN instead of polling: before
-- it sleeps it sets the queue's doorbell sequence to the time (ms since the epoch) until which
-- it listens, and an event producer that finds that time ahead of its clock notifies it.  A
-- sequence, not a row: setting it is not transactional, so a producer sees it at once, whatever
-- its snapshot.  create_queue makes the sequence of a new queue; these are the existing ones'.
do $$
declare
    q record;
begin
    for q in select queue_id from pgcascade.queue loop
        execute format('create sequence if not exists pgcascade.%I minvalue 0 start 0',
                       format('event_%s_wake_seq', q.queue_id));
    end loop;
end $$;
