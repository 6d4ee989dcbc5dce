-- pgcascade.create_queue(queue_name) -> 1 if created, 0 if it already existed.
-- Creates the queue row, its event id sequence, its doorbell (doorbell.sql), its event
-- partitions and a first tick, so that consumers registering at once have a position to start
-- from.
-- Tables: queue, tick, event (partitions).
create or replace function pgcascade.create_queue(i_queue_name text) returns int4
language plpgsql as $$
declare
    qid int4;
    seq text;
begin
    if i_queue_name is null or btrim(i_queue_name) = '' then
        raise exception 'queue name must not be empty' using errcode = '22023';
    end if;
    perform 1 from pgcascade.queue where queue_name = i_queue_name;
    if found then
        return 0;
    end if;
    qid := nextval('pgcascade.queue_id_seq');
    if qid > 100000000 then
        raise exception 'too many queues created (queue id %)', qid;
    end if;
    seq := format('pgcascade.event_%s_id_seq', qid);
    execute format('create sequence %s', seq);
    execute format('create sequence if not exists %s minvalue 0 start 0', pgcascade.doorbell_name(qid));
    insert into pgcascade.queue (queue_id, queue_name, queue_event_seq) values (qid, i_queue_name, seq::regclass);
    perform pgcascade.queue_ensure_parts(qid, 3);
    perform pgcascade.ticker(i_queue_name);
    return 1;
end $$;
