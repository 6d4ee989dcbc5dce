-- pgcascade.drop_queue(queue_name, force default false) -> 1.
-- Refuses while consumers are registered, unless force.  Dropping partitions takes a brief
-- exclusive lock on the event parent; lock_timeout keeps it from queueing inserts for long.
create or replace function pgcascade.drop_queue(i_queue_name text, i_force bool default false) returns int4
language plpgsql as $$
declare
    q pgcascade.queue;
    n int4;
    part record;
begin
    q := pgcascade.find_queue(i_queue_name);
    select count(*) into n from pgcascade.subscription where sub_queue = q.queue_id;
    if n > 0 and not i_force then
        raise exception 'queue "%" still has % registered consumer(s): unregister them or drop with force',
            i_queue_name, n using errcode = '55006';
    end if;
    perform set_config('lock_timeout', '5s', true);
    for part in select c.relname from pg_inherits i join pg_class c on c.oid = i.inhrelid
                 where i.inhparent = 'pgcascade.event'::regclass
                   and c.relname like format('event\_%s\_%%', q.queue_id) loop
        execute format('drop table pgcascade.%I', part.relname);
    end loop;
    delete from pgcascade.queue where queue_id = q.queue_id;
    execute format('drop sequence %s', q.queue_event_seq);
    execute format('drop sequence if exists %s', pgcascade.doorbell_name(q.queue_id));
    return 1;
end $$;
